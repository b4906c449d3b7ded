"""Recall of the indexer's top-k under fp8 keys and queries against fp32 scoring, with and without the
Hadamard rotation (indexer_hadamard): on synthetic vectors, or on a trained model's cache (--run).

    python benchmarks/indexer_fp8_recall.py                       # synthetic: 32K keys, 8 queries, k = 2048
    python benchmarks/indexer_fp8_recall.py --keys 131072 --outlier 30
    python benchmarks/indexer_fp8_recall.py --make-corpus /tmp/corpus   # the repo's own text, for train.py
    python benchmarks/indexer_fp8_recall.py --run outputs/sparse --topk 32 256   # a trained run's cache

Synthetic (the default): 128-dim Gaussian vectors whose channels carry log-normal scales and a few
outlier channels --outlier times larger (the shape of LayerNorm'd activations that makes per-block fp8
lossy: one outlier sets the block's scale and the small channels round to few levels), 64 heads,
positive head weights.

Trained (--run <run folder>, train.py's: its config.yml and newest checkpoint; scan_layers=false): each
held-out document (--documents, default the run's eval_dataset_path; the first --docs of at least
--context tokens) runs through the model layer by layer; at every layer the indexer keys of all
--context tokens (Indexer.keys: what the decode cache stores) and the indexer queries and weights of
--queries decode positions spread over the context's second half (a query at position p sees keys
0..p, as a decode step at p does). Reported per layer and k: the indexer's own quality (the share of
the dense attention's top-k, attention probabilities summed over heads, that its fp32 top-k holds,
and the share of that attention mass its selection holds), the recall of each fp8 variant, and the
attention-output error the fp8 selection causes: |out(fp8 top-k) - out(fp32 top-k)| / |out(fp32 top-k)|
of the layer's attention output (after wo; MLA.attend over the selection), beside the same error of
the fp32 top-k against dense attention for scale.

Scores are the indexer's sum_h w relu(q.k) (kernels/paged_decode.paged_index_scores_xla, the decode
path's reference). Variants: fp8 keys (e4m3, one scale per 128-block: the fp8 cache today) with fp32
queries; fp8 keys and fp8 queries (one scale per head: paged_decode.fp8_queries, as DeepSeek's release
scores in fp8); each with the vectors as they are and after the Hadamard rotation (orthogonal: the
fp32 scores are unchanged, outliers spread over all channels). Recall = |top-k(variant) & top-k(fp32)|
/ k, the mean over queries. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from MaxText.inference.kv_cache import quantize_fp8
from MaxText.kernels import paged_decode as pd
from MaxText.layers.indexer import hadamard_matrix

H, D = 64, 128
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ("fp8_keys", "fp8_keys_and_queries")  # the fp8 operands, each with rotation none | hadamard


def vectors(key, n: int, channels: jax.Array, shape) -> jax.Array:
  """[n, *shape, D] Gaussian vectors times per-channel scales (channels [D])."""
  return jax.random.normal(key, (n, *shape, D)) * channels


def scores(q, q_scale, w, k, k_scale, pos=None) -> jax.Array:
  """[n, S] indexer scores sum_h w relu(q.k): query row i (q [n,H,d], w [n,H] already times d**-0.5:
  pd.index_weights) over the keys k [S,d] (one page of S slots, as stored: f32, or fp8 bits with
  k_scale [S,1]); slots past pos[i] (default S - 1: every key) score -inf."""
  n, s = q.shape[0], k.shape[0]
  pos = jnp.full((n,), s - 1, jnp.int32) if pos is None else pos
  return pd.paged_index_scores_xla(q, q_scale, w, k, k_scale, jnp.zeros((n, 1), jnp.int32), pos, s)  # [n,S]


def topk_mask(x: jax.Array, k: int) -> jax.Array:
  """x [n,S] -> bool [n,S]: each row's top-k (lax.top_k's set: ties lowest position first)."""
  idx = jax.lax.top_k(x, k)[1]  # [n,k]
  return jnp.zeros(x.shape, bool).at[jnp.arange(x.shape[0])[:, None], idx].set(True)


def recall(got: jax.Array, ref: jax.Array, k: int) -> float:
  """Mean over rows of |top-k(got) & top-k(ref)| / k; got, ref [n,S]."""
  return float(jnp.mean(jnp.sum(topk_mask(got, k) & topk_mask(ref, k), axis=-1)) / k)


def fp8_variants(q: jax.Array, w: jax.Array, k: jax.Array, rotate: bool, pos=None) -> dict[str, jax.Array]:
  """The fp8 variants' scores [n,S] of queries q [n,H,d] (weights w [n,H]) over keys k [S,d], after the
  Hadamard rotation when `rotate` (as indexer_hadamard applies it: x @ H after RoPE)."""
  hm = jnp.asarray(hadamard_matrix(k.shape[-1])) if rotate else jnp.eye(k.shape[-1])
  kr, qr = k @ hm, q @ hm  # [S,d], [n,H,d]; orthogonal: fp32 scores unchanged
  kq, kscale = quantize_fp8(kr)  # e4m3 [S,d], one scale per 128-block [S,1]
  kbits = jax.lax.bitcast_convert_type(kq, jnp.uint8)
  q8, qs = pd.fp8_queries(qr)  # [n,H,d] bits, [n,H]
  return {"fp8_keys": scores(qr, None, w, kbits, kscale, pos), "fp8_keys_and_queries": scores(q8, qs, w, kbits, kscale, pos)}


def synthetic(args) -> None:
  ks = jax.random.split(jax.random.key(args.seed), 5)
  channels = jnp.exp(0.5 * jax.random.normal(ks[0], (D,)))  # log-normal channel scales
  channels = channels.at[:args.outliers].multiply(args.outlier)
  k = vectors(ks[1], args.keys, channels, ())  # [S, D]
  q = vectors(ks[2], args.queries, channels, (H,))  # [n, H, D]
  w = jax.random.uniform(ks[3], (args.queries, H)) * H ** -0.5 * D ** -0.5
  ref = scores(q, None, w, k, None)
  topk = args.topk[0]
  rows = []
  print(f"{args.keys} keys, {args.queries} queries, k = {topk}; synthetic vectors, {args.outliers} outlier "
        f"channels x{args.outlier}")
  print(f"{'rotation':>9} {'fp8 keys':>9} {'fp8 keys + queries':>19}")
  for rotate in (False, True):
    got = fp8_variants(q, w, k, rotate)
    r = {v: recall(got[v], ref, topk) for v in VARIANTS}
    name = "hadamard" if rotate else "none"
    rows.append(dict(rotation=name, **{v: round(r[v], 4) for v in VARIANTS}))
    print(f"{name:>9} {r['fp8_keys']:>9.4f} {r['fp8_keys_and_queries']:>19.4f}")
  print(json.dumps(dict(benchmark="indexer_fp8_recall", keys=args.keys, queries=args.queries, topk=topk,
                        outlier=args.outlier, outliers=args.outliers, data="synthetic", rows=rows)))


# ---------------------------------------------------------------- the repo's text, for a training run


def make_corpus(out: str, root: str = REPO) -> dict[str, int]:
  """Writes out/train/train.jsonl (docs/*.md and MaxText/**/*.py) and out/eval/eval.jsonl (benchmarks/*.py,
  held out), one record {"text": a whole file} per file: documents long enough that a 2048-4096 token
  row is mostly one document (dataset_type=file packs the stream; attention stays within a document).
  Returns the files written per split."""
  splits = {"train": sorted(glob.glob(os.path.join(root, "docs", "*.md")))
                     + sorted(glob.glob(os.path.join(root, "MaxText", "**", "*.py"), recursive=True)),
            "eval": sorted(glob.glob(os.path.join(root, "benchmarks", "*.py")))}
  for split, files in splits.items():
    os.makedirs(os.path.join(out, split), exist_ok=True)
    with open(os.path.join(out, split, f"{split}.jsonl"), "w", encoding="utf-8") as f:
      for path in files:
        with open(path, encoding="utf-8") as src:
          f.write(json.dumps({"text": src.read(), "file": os.path.relpath(path, root)}) + "\n")
  return {split: len(files) for split, files in splits.items()}


# ---------------------------------------------------------------- a trained model's cache


def decoder_layers(model) -> list:
  """The model's DecoderLayers in Transformer.__call__'s order (dense_layers, then moe_layers); unscanned."""
  return [layer for name in ("dense_layers", "moe_layers") if getattr(model, name) is not None
          for layer in getattr(model, name).layers]


def layer_inputs(model, tokens: jax.Array) -> tuple[list[jax.Array], jax.Array]:
  """tokens [1,T] through an unscanned model, layer by layer as Transformer.__call__ runs it -> (each
  layer's attention input pre_attention_norm(x) [1,T,D], the last layer's output [1,T,D]:
  model.logits(model.final_norm(it)) is the model's logits)."""
  pos = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]  # [1,T]
  x = model.embed(tokens)  # [1,T,D]
  inputs = []
  for layer in decoder_layers(model):
    inputs.append(layer.pre_attention_norm(x))
    x, _ = layer(x, pos, None)
  return inputs, x


@nnx.jit(static_argnums=(3, 4))
def layer_figures(mla, x: jax.Array, qpos: jax.Array, ks: tuple[int, ...], rotated: bool) -> dict:
  """One layer, one document: x [1,T,D] the layer's normed input, qpos [n] the decode positions (each >=
  max(ks) - 1). `rotated`: the model applies indexer_hadamard (its q, k come rotated; unrotated here
  with H = H^T = H^-1). -> {k: {figure: [n] per query}}, the figures named as in the table."""
  t = x.shape[1]
  pos = jnp.arange(t, dtype=jnp.int32)[None]  # [1,T]
  idx = mla.indexer
  q_nope, q_pe, q_lat = mla.project_q(x, pos)  # [1,T,h,nope], [1,T,h,rope], [1,T,q_lora]
  k_i = idx.keys(x, pos)[0]  # [T,d]: what the decode cache stores (MLA.attend_cached)
  q_i, w_i = idx.queries(x, q_lat, pos)  # [1,T,H,d], [1,T,H]
  q_i, w_i = q_i[0, qpos], pd.index_weights(w_i[0, qpos], k_i.shape[-1])  # [n,H,d], [n,H]
  if rotated:
    hm = jnp.asarray(hadamard_matrix(k_i.shape[-1]))
    k_i, q_i = k_i @ hm, q_i @ hm
  ref = scores(q_i, None, w_i, k_i, None, qpos)  # [n,T] fp32 scoring
  got = {rot: fp8_variants(q_i, w_i, k_i, rot == "hadamard", qpos) for rot in ("none", "hadamard")}

  c_kv, k_pe = mla.project_kv(x, pos)  # [1,T,kv_lora], [1,T,rope]
  k_nope, v = mla.expand_kv(c_kv)  # [1,T,h,nope], [1,T,h,v]
  qn, qp = q_nope[:, qpos], q_pe[:, qpos]  # [1,n,h,nope], [1,n,h,rope]

  def attend(mask):  # mask [n,T] -> attention output after wo [n,D], probs summed over heads [n,T]
    o, probs = mla.attend(qn, qp, k_nope, k_pe, v, mask[None])  # [1,n,h,v], [1,h,n,T]
    return mla.wo(o.reshape(1, qpos.shape[0], -1))[0], jnp.sum(probs[0], axis=0)

  def err(a, b):  # [n,D] -> [n]
    return jnp.linalg.norm(a - b, axis=-1) / jnp.maximum(jnp.linalg.norm(b, axis=-1), 1e-30)

  causal = pos <= qpos[:, None]  # [n,T]
  dense, p = attend(causal)
  out = {}
  for k in ks:
    sel = topk_mask(ref, k)  # [n,T]
    sparse, _ = attend(sel)
    f = {"attn_topk_recall": jnp.sum(sel & topk_mask(jnp.where(causal, p, -jnp.inf), k), -1) / k,
         "attn_mass": jnp.sum(jnp.where(sel, p, 0.0), -1) / jnp.sum(p, -1),
         "sparse_vs_dense_err": err(sparse, dense)}
    for rot, by in got.items():
      for name, s in by.items():
        mine = topk_mask(s, k)
        f[f"{rot}/{name}"] = jnp.sum(mine & sel, -1) / k
        f[f"{rot}/{name}/out_err"] = err(attend(mine)[0], sparse)
    out[k] = f
  return out


COLUMNS = [("attn_topk_recall", "idx~attn"), ("attn_mass", "attn mass"),
           ("none/fp8_keys", "k8"), ("none/fp8_keys_and_queries", "k8q8"),
           ("hadamard/fp8_keys", "H k8"), ("hadamard/fp8_keys_and_queries", "H k8q8"),
           ("none/fp8_keys_and_queries/out_err", "err k8q8"), ("hadamard/fp8_keys_and_queries/out_err", "err H k8q8"),
           ("sparse_vs_dense_err", "err sparse")]


def trained(args) -> None:
  from MaxText.checkpoint import model_state
  from MaxText.config import pyconfig
  from MaxText.data.documents import read_documents
  from MaxText.data.tokenizer import load_tokenizer
  from MaxText.runtime import cli, sharding

  cli.quiet_libraries()
  config_path = os.path.join(args.run, "config.yml")
  if not os.path.isfile(config_path):
    sys.exit(f"indexer_fp8_recall: --run {args.run} has no config.yml: give a train.py run folder")
  config = pyconfig.initialize(["indexer_fp8_recall", config_path, *args.set])
  if config.scan_layers or not config.use_indexer:
    sys.exit(f"indexer_fp8_recall: --run {args.run} needs use_indexer=true and scan_layers=false (got "
             f"use_indexer={config.use_indexer}, scan_layers={config.scan_layers})")
  t = args.context or config.max_target_length
  ks = sorted(args.topk)
  if ks[-1] > t // 2:
    sys.exit(f"indexer_fp8_recall: --topk {ks[-1]} needs --context >= {2 * ks[-1]} (got {t})")
  path = args.documents or config.eval_dataset_path
  docs, _ = read_documents(path, config.jsonl_text_field)
  tok = load_tokenizer(config)
  ids = [[tok.bos_id] + tok.encode(d) for d in docs]
  ids = [i[:t] for i in ids if len(i) >= t][:args.docs]
  if not ids:
    sys.exit(f"indexer_fp8_recall: no document in --documents {path} has {t} tokens (--context)")
  qpos = jnp.asarray(np.linspace(t // 2, t - 1, args.queries).astype(np.int32))  # [n]
  mesh = sharding.create_mesh(config)
  with jax.set_mesh(mesh), sharding.logical_rules(config, mesh):
    graphdef, params, buffers, _ = model_state.load_parameters(os.path.join(args.run, "checkpoints"), config, mesh,
                                                               report=print)
    model = model_state.merge(graphdef, params, buffers)
    mlas = [layer.attention for layer in decoder_layers(model)]
    forward = nnx.jit(layer_inputs)
    per = {}  # (layer, k, figure) -> [values over documents x queries]
    for doc in ids:
      inputs, _ = forward(model, jnp.asarray(doc, jnp.int32)[None])
      for li, (mla, x) in enumerate(zip(mlas, inputs)):
        for k, figs in layer_figures(mla, x, qpos, tuple(ks), config.indexer_hadamard).items():
          for name, v in figs.items():
            per.setdefault((li, k, name), []).extend(np.asarray(v).tolist())
  rows = [dict(layer=li, topk=k, **{name: round(float(np.mean(per[(li, k, name)])), 4) for name, _ in COLUMNS})
          for li in range(len(mlas)) for k in ks]
  chance = {k: round(float(np.mean(k / (np.asarray(qpos) + 1))), 4) for k in ks}  # a random k of the p + 1 keys
  print(f"{args.run}: {len(ids)} held-out document(s) of {t} tokens, {args.queries} decode queries each "
        f"(positions {t // 2}..{t - 1}); indexer {config.indexer_n_heads} heads x {config.indexer_head_dim}; "
        f"a random selection's idx~attn: {chance}")
  print(" ".join(f"{h:>10}" for h in ("layer", "k", *(c for _, c in COLUMNS))))
  for r in rows:
    print(" ".join(f"{v:>10}" for v in (r["layer"], r["topk"], *(f"{r[n]:.4f}" for n, _ in COLUMNS))))
  print(json.dumps(dict(benchmark="indexer_fp8_recall", data="trained", run=args.run, context=t, docs=len(ids),
                        queries=args.queries, indexer_heads=config.indexer_n_heads, chance=chance,
                        indexer_head_dim=config.indexer_head_dim, rows=rows)))


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--keys", type=int, default=32768, help="synthetic: keys")
  ap.add_argument("--queries", type=int, default=None, help="queries (synthetic default 8; --run: per document, 32)")
  ap.add_argument("--topk", type=int, nargs="+", default=None, help="k (synthetic default 2048; --run: 32 256)")
  ap.add_argument("--outlier", type=float, default=20.0, help="synthetic: how much larger the outlier channels are")
  ap.add_argument("--outliers", type=int, default=4, help="synthetic: how many outlier channels")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--run", default="", help="a train.py run folder: measure on its model's cache")
  ap.add_argument("--documents", default="", help="--run: held-out .txt/.jsonl (default: the run's eval_dataset_path)")
  ap.add_argument("--docs", type=int, default=2, help="--run: held-out documents measured")
  ap.add_argument("--context", type=int, default=0, help="--run: tokens of each document (default max_target_length)")
  ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="--run: config overrides")
  ap.add_argument("--make-corpus", default="", metavar="OUT", help="write the repo's text as OUT/{train,eval}/*.jsonl")
  args = ap.parse_args(argv)
  if args.make_corpus:
    print(json.dumps(dict(corpus=args.make_corpus, files=make_corpus(args.make_corpus))))
  elif args.run:
    from MaxText.runtime import cli
    args.queries, args.topk = args.queries or 32, args.topk or [32, 256]
    cli.run(lambda: trained(args))  # a config, data or checkpoint mistake: one line, no traceback
  else:
    args.queries, args.topk = args.queries or 8, args.topk or [2048]
    synthetic(args)


if __name__ == "__main__":
  main()
