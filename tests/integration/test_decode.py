"""Decode over the paged caches (the serving engine's step: the model's call with a cache, then
the write): prefill + step-by-step decode equals the teacher-forced Transformer at every position
(with selection mattering), absorbed == expanded MLA attention over the cache, chunked == one-shot
prefill, fp8 stays close to fp32, a ragged batch equals each prompt alone and the teacher-forced
argmax, EOS per row, and the CLI end to end (tokenizers, token ids, a checkpoint, top_p, the
error cases)."""

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText import decode
from MaxText.checkpoint import model_state
from MaxText.inference import kv_cache, paged_pools
from MaxText.inference.cache_view import CacheView, stack_views, write_stacks
from MaxText.inference.model_step import model_absorbed_weights
from MaxText.inference.scheduler import SamplingParams
from MaxText.inference.serving import ServingEngine
from MaxText.kernels.masks import attention_validity
from MaxText.layers.attention_mla import MLA
from MaxText.runtime import sharding
from tests.conftest import REPO_ROOT, make_config
from tests.support.decode_cli import decode_cli

DATA = os.path.join(REPO_ROOT, "tests", "data")
S, K = 48, 8  # cache length; indexer top-k well below it, so the selection matters
# param_init_std 0.2: attention far from uniform, so sparse and dense attention really differ
BASE = dict(max_target_length=S, max_prefill_length=24, indexer_topk=K, param_init_std=0.2, mtp_num_layers=0,
            serve_page_size=8, serve_max_num_seqs=4, serve_max_num_tokens=32,
            serve_width_buckets=1, serve_context_buckets=1)  # few step shapes: few compiles (the server tests run the defaults)
_MODELS = {}


def _model(**kw):
  """(config, graphdef, params, buffers), random init, cached per config."""
  key = tuple(sorted({**BASE, **kw}.items()))
  if key not in _MODELS:
    cfg = make_config(**dict(key))
    _MODELS[key] = (cfg,) + tuple(model_state.create(cfg, sharding.create_mesh(cfg))[:3])
  return _MODELS[key]


def _teacher_forced(cfg, graphdef, params, buffers, tokens):
  return jax.jit(lambda p, b, t: model_state.merge(graphdef, p, b)(t)[0])(params, buffers, tokens)


def _rel_rows(got, want):
  """Relative error per position: ||got - want|| / ||want|| over the vocabulary, [b,t]."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)


def _paged_decode(cfg, graphdef, params, buffers, tokens, prompt_len, mode="sparse"):
  """Logits [b,T,V] over paged pools, as a serving step computes them (cache_view.stack_views over
  the pools and a page table, the model's call with that cache, paged_pools.write of its entries):
  the prompt in one call, then one token per call. Row i holds pages i*P .. i*P + P - 1."""
  b, t = tokens.shape
  page = cfg.serve_page_size
  per_row = -(-t // page)
  pools = paged_pools.init_pools(cfg, b * per_row, page)
  table = jnp.arange(b * per_row, dtype=jnp.int32).reshape(b, per_row)  # [b,P]

  @functools.partial(jax.jit, static_argnums=0)
  def step(head_chunk, pools, tokens, positions):
    model = nnx.merge(graphdef, params, buffers)
    views = stack_views(pools, model_absorbed_weights(model), mode=mode, index_head_chunk=head_chunk,
                        page_table=table, page_size=page)
    logits, aux = model(tokens, positions, cache=views)  # [b,n,V]
    slot_ids = paged_pools.slots(table, positions, page, b * per_row * page)
    return logits, write_stacks(pools, aux["cache_entries"], lambda pool, **e: paged_pools.write(pool, slot_ids, **e))

  out = []
  for lo, hi in [(0, prompt_len)] + [(i, i + 1) for i in range(prompt_len, t)]:
    positions = jnp.broadcast_to(jnp.arange(lo, hi, dtype=jnp.int32), (b, hi - lo))
    logits, pools = step(cfg.indexer_head_chunk if hi - lo > 1 else cfg.indexer_n_heads, pools, tokens[:, lo:hi],
                         positions)
    out.append(logits)
  return jnp.concatenate(out, axis=1)


def _greedy_teacher_forced(cfg, graphdef, params, buffers, prompt, n):
  """n greedy tokens after prompt, each the argmax of the whole sequence's teacher-forced forward
  (no cache; the sequence padded to max_target_length, which the causal model never attends to)."""
  fwd = jax.jit(lambda p, b, t: model_state.merge(graphdef, p, b)(t)[0])
  seq = list(prompt)
  for _ in range(n):
    padded = np.zeros((1, cfg.max_target_length), np.int32)
    padded[0, :len(seq)] = seq
    seq.append(int(jnp.argmax(fwd(params, buffers, padded)[0, len(seq) - 1])))
  return seq[len(prompt):]


# ---------------------------------------------------------------- exactness


@pytest.mark.parametrize("scan_layers,score_bytes", [(True, 536870912), (False, 536870912), (True, 2048)])
def test_prefill_and_step_decode_equal_the_teacher_forced_forward(scan_layers, score_bytes):
  # score_bytes 2048: the prompt's indexer scores in blocks of 3 queries, one head at a time
  cfg, graphdef, params, buffers = _model(scan_layers=scan_layers, serve_max_index_score_bytes=score_bytes)
  tokens = jax.random.randint(jax.random.key(3), (2, S), 3, cfg.vocab_size)
  want = _teacher_forced(cfg, graphdef, params, buffers, tokens)  # [b,S,V], the mask path
  got = _paged_decode(cfg, graphdef, params, buffers, tokens, prompt_len=20)
  rel = _rel_rows(got, want)
  assert rel.max() <= 1e-4, np.round(rel, 6)
  # The selection matters: dense attention over the same cache departs once a query sees > k keys
  # (and equals the sparse model while it sees <= k), so a decode that ignored the selection fails.
  dense = _paged_decode(cfg, graphdef, params, buffers, tokens, 20, mode="dense")
  rel_dense = _rel_rows(dense, want)
  assert rel_dense[:, :K].max() <= 1e-4
  assert rel_dense[:, 2 * K:].min() > 1e-2, np.round(rel_dense, 4)


def test_decode_selection_breaks_ties_like_the_training_mask():
  # The model's mask path and the decode path must pick the same keys when scores tie at the k-th
  # value (relu makes exact ties common: a key every indexer head scores <= 0 gets exactly 0).
  from MaxText.kernels.topk_indices import topk_indices
  from MaxText.layers.indexer import Indexer
  cfg = make_config(indexer_topk=5)
  scores = jnp.asarray([[[0.0, 3.0, 0.0, -0.0, 0.0, 2.0, 0.0, -1.0, 0.0, 0.0, -jnp.inf, 1.0]]], jnp.float32)
  mask = Indexer(cfg, rngs=nnx.Rngs(0)).select(scores)  # what the teacher-forced forward attends to
  idx, ok = topk_indices(scores, cfg.indexer_topk)  # what a decode step gathers
  chosen = np.zeros(12, bool)
  chosen[np.asarray(idx)[0, 0][np.asarray(ok)[0, 0]]] = True
  np.testing.assert_array_equal(chosen, np.asarray(mask)[0, 0])
  assert chosen.sum() == 5 and chosen[[0, 1, 2, 5, 11]].all()  # the ties at 0 taken lowest position first


def _mla(seed=0, **kw):
  cfg = make_config(**{**BASE, "max_target_length": 16, "max_prefill_length": 16, "indexer_topk": 4, **kw})
  return cfg, MLA(cfg, rngs=nnx.Rngs(seed))


def test_absorbed_attention_over_the_cache_equals_the_expanded_mla_layer():
  cfg, attn = _mla()
  b, t = 2, 12
  x = jax.random.normal(jax.random.key(1), (b, t, cfg.emb_dim))
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  graphdef, state = nnx.split(attn)

  @jax.jit
  def expanded(state, x):  # the model's own layer: per-head keys/values from wkv_b, mask path
    return nnx.merge(graphdef, state)(x, pos)[0]

  def absorbed(mode, chunks):  # the layer over the cache (MLA.attend_cached): in pieces, committing between
    cache = kv_cache.init_layer_cache(cfg, b, length=16)
    outs, at = [], 0
    for n in chunks:
      p = pos[:, at:at + n]
      out, entries = jax.jit(lambda s, c, x, p: nnx.merge(graphdef, s).attend_cached(
          x, p, CacheView(c, None, mode=mode, index_head_chunk=4)))(state, cache, x[:, at:at + n], p)
      cache = kv_cache.write(cache, p[:, 0], **entries)
      outs.append(out)
      at += n
    return jnp.concatenate(outs, axis=1)

  want = expanded(state, x)
  for chunks in ((12,), (7, 5), (5, 1, 1, 5)):
    got = absorbed("sparse", chunks)
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) <= 1e-5, chunks

  # dense: the same layer with every valid key (MLA.attend over expand_kv, non-absorbed)
  @jax.jit
  def expanded_dense(state, x):
    m = nnx.merge(graphdef, state)
    q_nope, q_pe, _ = m.project_q(x, pos)
    c_kv, k_pe = m.project_kv(x, pos)
    k_nope, v = m.expand_kv(c_kv)
    out, _ = m.attend(q_nope, q_pe, k_nope, k_pe, v, attention_validity(pos, pos))
    return m.wo(out.reshape(b, t, -1))

  want_d = expanded_dense(state, x)
  got_d = absorbed("dense", (7, 5))
  assert float(jnp.linalg.norm(got_d - want_d) / jnp.linalg.norm(want_d)) <= 1e-5
  assert float(jnp.linalg.norm(want_d - want) / jnp.linalg.norm(want)) > 1e-2  # top-4 of 12 keys matters


def test_chunked_prefill_equals_one_shot_prefill():
  # The serving engine prefills in chunks of prefill_chunk_size (0: max_prefill_length at once): the
  # first token's logits (and so every greedy token) must not depend on the chunk.
  prompts = [list(range(3, 20)), list(range(40, 49)), list(range(100, 123))]  # 17, 9, 23 tokens
  results = {}
  for chunk in (0, 5):  # 5: no divisor of any prompt or page
    cfg, graphdef, params, buffers = _model(prefill_chunk_size=chunk)
    eng = ServingEngine(cfg, graphdef, params, buffers, eos_id=-1)
    assert eng.chunk == (chunk or cfg.max_prefill_length)
    results[chunk] = [r.output for r in eng.generate(prompts, SamplingParams(max_tokens=10))]
  assert results[5] == results[0]


@pytest.mark.parametrize("dtype,tol", [("bfloat16", 0.01), ("fp8", 0.02)])
def test_low_precision_caches_decode_close_to_fp32(dtype, tol):
  # The default init (std 0.02): at std 0.2 the 4-layer model is chaotic (peaky attention, routing
  # and top-k flips amplify any perturbation), which would measure the model, not the cache.
  tokens = jax.random.randint(jax.random.key(5), (2, S), 3, 512)
  cfg, graphdef, params, buffers = _model(param_init_std=0.02)
  ref = _paged_decode(cfg, graphdef, params, buffers, tokens, 20)
  cfg_q = make_config(**{**BASE, "param_init_std": 0.02, "kv_cache_dtype": dtype})
  assert kv_cache.bytes_per_token_per_layer(cfg_q) < kv_cache.bytes_per_token_per_layer(cfg)
  got = _paged_decode(cfg_q, graphdef, params, buffers, tokens, 20)
  rel = _rel_rows(got, ref)
  agree = np.mean(np.argmax(np.asarray(got), -1) == np.argmax(np.asarray(ref), -1))
  print(f"\n{dtype} cache vs fp32: logits rel error mean {rel.mean():.4f} max {rel.max():.4f}, argmax agrees "
        f"{agree:.3f}; {kv_cache.bytes_per_token_per_layer(cfg_q)} vs {kv_cache.bytes_per_token_per_layer(cfg)} "
        "bytes/token/layer")
  assert 0 < rel.max() <= tol  # > 0: the cache really is rounded
  assert agree >= 0.97, agree


def _top_level_ops(hlo: str):
  """(computation, instruction line) for every instruction outside fused computations."""
  comp = None
  for line in hlo.split("\n"):
    head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
    if head:
      comp = head.group(2)
    elif comp and " = " in line and not comp.startswith(("fused_", "wrapped_")):
      yield comp, line.strip()


def test_a_decode_step_never_copies_the_latent_pools(production_emitters):
  # A serving step must touch O(k) rows of the latent pools: no top-level op may produce a pool-sized
  # array from them (a copy, a select over them, a dequantization of all of them). XLA:CPU did copy
  # the cache, several times per step, while one program both updated it in place and fed it to a
  # matmul; the step only reads the pools and the write program only scatters the new entries.
  # Allowed: the per-layer slice of the indexer-key pool in a scanned stack (the scoring reads every
  # key of the row: O(S * indexer_head_dim), the same order as the scoring itself).
  cfg = make_config(**{**BASE, "max_target_length": 4096, "max_prefill_length": 16})
  graphdef, params, buffers, _ = model_state.create(cfg, sharding.create_mesh(cfg))
  eng = ServingEngine(cfg, graphdef, params, buffers)
  step, write, _ = eng.compile_step(2, 1)  # 2 rows of 1 token over the whole page table (a 4096-token context)
  pools = eng.pools.values()
  latent = {f"[{','.join(map(str, a.shape[i:]))}]" for lc in pools for a in (lc.c_kv, lc.k_pe) for i in (0, 1)}
  keys = {f"[{','.join(map(str, lc.idx_k.shape[i:]))}]" for lc in pools for i in (0, 1)}  # [L,N,d], [N,d]
  passive = ("parameter(", "bitcast(", "get-tuple-element(", "tuple(", "constant(")
  programs = {"step": step, "write": write}
  for name, compiled in programs.items():
    for comp, line in _top_level_ops(compiled.as_text()):
      out = line.split(" = ", 1)[1].split(" ")[0]  # the result shape, e.g. f32[3,16384,8]{2,1,0}
      sized = any(sh in out for sh in latent | keys)
      if not sized or any(op in line for op in passive):
        continue
      if name == "write" and "scatter" in line:
        continue  # the in-place write
      if name == "step" and "dynamic-slice" in line and any(sh in out for sh in keys):
        continue  # a scanned stack's layer of indexer keys, for the scoring
      pytest.fail(f"{name} program materializes a pool-sized array ({comp}): {line[:200]}")
  assert "input_output_alias" in programs["write"].as_text()  # donated: written in place


# ---------------------------------------------------------------- generation


def test_concurrent_ragged_greedy_requests_equal_the_teacher_forced_argmax_and_eos_stops_its_row():
  cfg, graphdef, params, buffers = _model(prefill_chunk_size=8)
  prompts = [[1, 17, 42, 9, 300], [1] + list(range(60, 72)), [1, 5, 6, 7, 8, 9, 10, 11, 12]]  # 5, 13, 9
  want = [_greedy_teacher_forced(cfg, graphdef, params, buffers, p, 12) for p in prompts]
  eng = ServingEngine(cfg, graphdef, params, buffers, eos_id=-1)
  batch = eng.generate(prompts, SamplingParams(max_tokens=12))
  assert [r.output for r in batch] == want
  assert all(r.finish_reason == "length" for r in batch)
  # EOS: make row 1's 4th greedy token the EOS; that row stops there, the others are unaffected
  eos = want[1][3]
  with_eos = ServingEngine(cfg, graphdef, params, buffers, eos_id=eos).generate(prompts, SamplingParams(max_tokens=12))
  assert with_eos[1].finish_reason == "stop" and with_eos[1].output == want[1][:3]
  for i in (0, 2):
    n = want[i].index(eos) if eos in want[i] else 12
    assert with_eos[i].output == want[i][:n]


def test_decode_fills_max_target_length_and_rejects_a_prompt_over_max_prefill_length():
  cfg, graphdef, params, buffers = _model()
  prompts = [[1, 2, 3], list(range(3, 23))]
  eng = ServingEngine(cfg, graphdef, params, buffers, eos_id=-1)
  out = eng.generate(prompts, [decode.sampling(cfg, i, len(p)) for i, p in enumerate(prompts)])
  assert [len(r.prompt) + len(r.output) for r in out] == [S, S]
  assert all(r.finish_reason == "length" for r in out)
  with pytest.raises(decode.PromptError, match="max_prefill_length=24"):
    decode.check_prompts(cfg, [list(range(3, 30))])


# ---------------------------------------------------------------- the CLI


def _rows(stdout):
  stops = dict(re.findall(r"^row (\d+): stop=(\S+)", stdout, re.M))
  ids = {int(i): [int(x) for x in v.split(",") if x] for i, v in re.findall(r"^row (\d+) ids: ?(.*)$", stdout, re.M)}
  return stops, ids


@pytest.mark.slow
def test_cli_streams_text_with_a_sentencepiece_tokenizer():
  r = decode_cli(f"tokenizer_path={DATA}/tokenizer.model", "prompt=I love to", "max_target_length=24",
           "max_prefill_length=16", "prefill_chunk_size=4")
  assert r.returncode == 0, r.stderr
  assert "RANDOM parameters" in r.stdout.splitlines()[0]
  stops, ids = _rows(r.stdout)
  assert stops == {"0": "max_target_length"} or stops == {"0": "eos"}
  streamed = r.stdout.splitlines()[1]
  assert streamed.startswith("I love to")  # the prompt, then the generated text as it came
  from MaxText.data.tokenizer import load_tokenizer
  tok = load_tokenizer(tokenizer_type="sentencepiece", tokenizer_path=f"{DATA}/tokenizer.model")
  prompt = [tok.bos_id] + tok.encode("I love to")
  assert len(prompt) + len(ids[0]) == 24 or stops["0"] == "eos"
  assert all(i < tok.vocab_size for i in ids[0])  # sampling stays inside the tokenizer's vocabulary
  assert streamed == tok.decode(prompt + ids[0]).rstrip("\n") or streamed.startswith(tok.decode(prompt))


@pytest.mark.slow
def test_cli_batch_of_text_prompts_with_an_hf_tokenizer_and_top_p():
  r = decode_cli("tokenizer_type=hf", f"tokenizer_path={DATA}/tokenizer.json", "prompt=The sea|I love to eat fish",
           "max_target_length=20", "max_prefill_length=16", "decode_sampling_strategy=top_p", "seed=3")
  assert r.returncode == 0, r.stderr
  stops, ids = _rows(r.stdout)
  assert set(stops) == {"0", "1"} and len(ids) == 2
  assert "[0] The sea ->" in r.stdout and "[1] I love to eat fish ->" in r.stdout


@pytest.mark.slow
def test_cli_token_ids_from_a_checkpoint_match_the_engine(tmp_path):
  cfg = make_config(max_target_length=20, max_prefill_length=8)
  graphdef, params, buffers, _ = model_state.create(cfg, sharding.create_mesh(cfg))
  path = str(tmp_path / "params")
  model_state.save_parameters(path, params, buffers)
  r = decode_cli(f"load_parameters_path={path}", "prompt=1,17,42|1,99,7,8,9", "max_target_length=20",
           "max_prefill_length=8")
  assert r.returncode == 0, r.stderr
  assert f"load_parameters_path={path}" in r.stdout and "RANDOM" not in r.stdout
  _, ids = _rows(r.stdout)
  want = [_greedy_teacher_forced(cfg, graphdef, params, buffers, p, 20 - len(p)) for p in ([1, 17, 42], [1, 99, 7, 8, 9])]
  want = [w[:w.index(cfg.eos_id)] if cfg.eos_id in w else w for w in want]
  assert [ids[0], ids[1]] == want


@pytest.mark.parametrize("args,code,message", [
    (["prompt=" + ",".join(["5"] * 40)], 2, "prompt has 40 tokens, more than max_prefill_length=32"),
    (["prompt=1,2", "load_parameters_path=/no/such/ckpt"], 1, "load_parameters_path='/no/such/ckpt'"),
    (["prompt=hello there"], 2, "tokenizer_path"),
    (["prompt=1,2,3,4", "max_target_length=4", "max_prefill_length=4"], 2, "fills max_target_length=4"),
    (["prompt=1,2,999"], 2, "outside [0, vocab_size=512)"),
    (["prompt=1,2", f"tokenizer_path={DATA}/missing.model"], 2, "tokenizer_path="),
    (["prompt=1,2", "kv_cache_dtype=int4"], 2, "kv_cache_dtype"),
])
def test_cli_bad_input_exits_nonzero_with_a_message(args, code, message):
  r = decode_cli(*args, timeout=120)
  assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
  assert message in r.stderr, r.stderr
  assert "Traceback" not in r.stderr
