"""Decode: prefill + step-by-step decode equals the teacher-forced Transformer at every position
(with selection mattering), absorbed == expanded MLA attention over the cache, chunked == one-shot
prefill, fp8 stays close to fp32, a ragged batch equals each prompt alone, EOS per row, sampling,
and the CLI end to end (tokenizers, token ids, a checkpoint, the error cases)."""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText.checkpoint import model_state
from MaxText.inference import engine as engine_lib
from MaxText.inference import kv_cache
from MaxText.inference.cache_view import CacheView
from MaxText.inference.engine import Engine
from MaxText.inference.sampling import sample
from MaxText.kernels.masks import attention_validity
from MaxText.layers.attention_mla import MLA
from MaxText.runtime import sharding
from tests.conftest import REPO_ROOT, make_config

DATA = os.path.join(REPO_ROOT, "tests", "data")
S, K = 48, 8  # cache length; indexer top-k well below it, so the selection matters
# param_init_std 0.2: attention far from uniform, so sparse and dense attention really differ
BASE = dict(max_target_length=S, max_prefill_length=24, indexer_topk=K, param_init_std=0.2, mtp_num_layers=0)
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


def _decode_teacher_forced(eng: Engine, tokens, prompt_len):
  """Logits [b,T,V]: forward over the prompt (one call), then one generate step per later token."""
  b, t = tokens.shape
  state, logits = eng.forward_tokens(eng.init_state(b), tokens[:, :prompt_len],
                                     np.broadcast_to(np.arange(prompt_len), (b, prompt_len)))
  out = [logits]
  for i in range(prompt_len, t):
    state, _, lg = eng.step(state, tokens[:, i], np.ones(b, bool), jax.random.key(0))
    out.append(lg[:, None])
  return jnp.concatenate(out, axis=1)


# ---------------------------------------------------------------- exactness


@pytest.mark.parametrize("scan_layers", [True, False])
def test_prefill_and_step_decode_equal_the_teacher_forced_forward(scan_layers):
  cfg, graphdef, params, buffers = _model(scan_layers=scan_layers)
  tokens = jax.random.randint(jax.random.key(3), (2, S), 3, cfg.vocab_size)
  want = _teacher_forced(cfg, graphdef, params, buffers, tokens)  # [b,S,V], the mask path
  eng = Engine(cfg, graphdef, params, buffers)
  assert eng.mode == "sparse"
  got = _decode_teacher_forced(eng, tokens, prompt_len=20)
  rel = _rel_rows(got, want)
  assert rel.max() <= 1e-4, np.round(rel, 6)
  # The selection matters: dense attention over the same cache departs once a query sees > k keys
  # (and equals the sparse model while it sees <= k), so a decode that ignored the selection fails.
  dense = _decode_teacher_forced(Engine(cfg, graphdef, params, buffers, attention="dense"), tokens, 20)
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
  prompts = [list(range(3, 20)), list(range(40, 49)), list(range(100, 123))]  # 17, 9, 23 tokens
  results = {}
  for chunk in (0, 5, 8):
    cfg, graphdef, params, buffers = _model(prefill_chunk_size=chunk)
    eng = Engine(cfg, graphdef, params, buffers)
    state, logits = eng.prefill(eng.init_state(3), prompts)
    lengths = [len(p) for p in prompts]
    cache = jax.tree.map(np.asarray, state.cache)
    results[chunk] = (np.asarray(logits), cache, eng.generate(prompts, eos_id=None, max_new_tokens=6))
  want_logits, want_cache, want_gen = results[0]
  for chunk in (5, 8):
    logits, cache, gen = results[chunk]
    assert np.max(_rel_rows(logits, want_logits)) <= 1e-5
    for name in ("c_kv", "k_pe", "idx_k"):
      got_f, want_f = getattr(cache["moe_layers"], name), getattr(want_cache["moe_layers"], name)  # [L,b,S,n]
      if name == "idx_k":  # stored [L,b,n,S]
        got_f, want_f = np.swapaxes(got_f, -1, -2), np.swapaxes(want_f, -1, -2)
      for row, n in enumerate(lengths):  # the prompt's slots (slots past it hold padding)
        a, w = got_f[:, row, :n], want_f[:, row, :n]  # fp32 rounding differs with the matmul shapes
        assert np.linalg.norm(a - w) <= 1e-5 * np.linalg.norm(w), (name, row)
    assert [g.tokens for g in gen] == [g.tokens for g in want_gen]


@pytest.mark.parametrize("dtype,tol", [("bfloat16", 0.01), ("fp8", 0.02)])
def test_low_precision_caches_decode_close_to_fp32(dtype, tol):
  # The default init (std 0.02): at std 0.2 the 4-layer model is chaotic (peaky attention, routing
  # and top-k flips amplify any perturbation), which would measure the model, not the cache.
  tokens = jax.random.randint(jax.random.key(5), (2, S), 3, 512)
  cfg, graphdef, params, buffers = _model(param_init_std=0.02)
  ref = _decode_teacher_forced(Engine(cfg, graphdef, params, buffers), tokens, 20)
  cfg_q = make_config(**{**BASE, "param_init_std": 0.02, "kv_cache_dtype": dtype})
  assert kv_cache.bytes_per_token_per_layer(cfg_q) < kv_cache.bytes_per_token_per_layer(cfg)
  got = _decode_teacher_forced(Engine(cfg_q, graphdef, params, buffers), tokens, 20)
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


def test_a_decode_step_never_copies_the_latent_cache():
  # A step must touch O(k) rows of the latent cache: no top-level op may produce a cache-sized
  # array from it (a copy, a select over it, a dequantization of all of it). XLA:CPU did copy it,
  # several times per step, while one program both updated the cache in place and fed it to a
  # matmul; the step now only reads the cache and `commit` only writes the new entries. Allowed:
  # the per-layer slice of the indexer keys in a scanned stack (the score matmul reads it whole:
  # O(S * indexer_head_dim), the same order as the scoring itself).
  cfg = make_config(**{**BASE, "max_target_length": 4096, "max_prefill_length": 16})
  graphdef, params, buffers, _ = model_state.create(cfg, sharding.create_mesh(cfg))
  eng = Engine(cfg, graphdef, params, buffers)
  state = eng.init_state(2)
  tok, key = jnp.zeros((2,), jnp.int32), jax.random.key(0)
  args = (params, buffers, state.cache, eng.absorbed, state.lengths, tok, key)
  entries = eng._step_jit.eval_shape(*args)[0]
  latent = {f"[{','.join(map(str, a.shape[i:]))}]" for lc in state.cache.values() for a in (lc.c_kv, lc.k_pe)
            for i in (0, 1)}  # stacked [L,b,S,n] and per-layer [b,S,n]
  keys = {f"[{','.join(map(str, lc.idx_k.shape[i:]))}]" for lc in state.cache.values() for i in (0, 1)}
  passive = ("parameter(", "bitcast(", "get-tuple-element(", "tuple(", "constant(")
  programs = {"step": eng._step_jit.lower(*args), "commit": eng._commit_jit.lower(state.cache, entries, state.lengths)}
  for name, lowered in programs.items():
    for comp, line in _top_level_ops(lowered.compile().as_text()):
      out = line.split(" = ", 1)[1].split(" ")[0]  # the result shape, e.g. f32[3,2,4096,8]{3,2,1,0}
      sized = any(sh in out for sh in latent | keys)
      if not sized or any(op in line for op in passive):
        continue
      if name == "commit" and "dynamic-update-slice" in line:
        continue  # the in-place write
      if name == "step" and "dynamic-slice" in line and any(sh in out for sh in keys):
        continue  # a scanned stack's layer of indexer keys, for the score matmul
      pytest.fail(f"{name} program materializes a cache-sized array ({comp}): {line[:200]}")
  assert "input_output_alias" in programs["commit"].compile().as_text()  # donated: written in place


# ---------------------------------------------------------------- generation


def test_greedy_ragged_batch_equals_each_prompt_alone_and_eos_stops_its_row():
  cfg, graphdef, params, buffers = _model(prefill_chunk_size=8)
  eng = Engine(cfg, graphdef, params, buffers)
  prompts = [[1, 17, 42, 9, 300], [1] + list(range(60, 72)), [1, 5, 6, 7, 8, 9, 10, 11, 12]]  # 5, 13, 9
  batch = eng.generate(prompts, eos_id=None, max_new_tokens=12)
  alone = [eng.generate([p], eos_id=None, max_new_tokens=12)[0] for p in prompts]
  assert [g.tokens for g in batch] == [g.tokens for g in alone]
  assert all(len(g.tokens) == 12 and g.stop == "max_new_tokens" for g in batch)
  # EOS: make row 1's 4th greedy token the EOS; that row stops there, the others are unaffected
  eos = batch[1].tokens[3]
  with_eos = eng.generate(prompts, eos_id=eos, max_new_tokens=12)
  assert with_eos[1].stop == "eos" and with_eos[1].tokens == batch[1].tokens[:3]
  for i in (0, 2):
    n = batch[i].tokens.index(eos) if eos in batch[i].tokens else 12
    assert with_eos[i].tokens == batch[i].tokens[:n]


def test_generation_stops_a_row_at_max_target_length():
  cfg, graphdef, params, buffers = _model()
  eng = Engine(cfg, graphdef, params, buffers)
  out = eng.generate([[1, 2, 3], list(range(3, 23))], eos_id=None)
  assert [len(g.prompt) + len(g.tokens) for g in out] == [S, S]
  assert all(g.stop == "max_target_length" for g in out)
  with pytest.raises(engine_lib.PromptError, match="max_prefill_length=24"):
    eng.generate([list(range(3, 30))], eos_id=None)


def test_sampling_greedy_top_p_and_temperature():
  logits = jax.random.normal(jax.random.key(0), (4, 50)) * 3
  key = jax.random.key(1)
  greedy = sample(logits, key, strategy="greedy")
  np.testing.assert_array_equal(greedy, jnp.argmax(logits, -1))
  np.testing.assert_array_equal(sample(logits, key, strategy="top_p", nucleus_p=1e-6), greedy)  # nucleus of 1
  a = sample(logits, key, strategy="temperature", temperature=1.0)
  np.testing.assert_array_equal(a, sample(logits, key, strategy="temperature", temperature=1.0))  # seeded
  draws = jax.vmap(lambda k: sample(logits[:1], k, strategy="temperature"))(jax.random.split(key, 4000))[:, 0]
  freq = np.bincount(np.asarray(draws), minlength=50) / 4000
  np.testing.assert_allclose(freq, np.asarray(jax.nn.softmax(logits[0])), atol=0.03)
  # top_p: never outside the smallest set of tokens with mass >= p
  p = 0.5
  probs = np.asarray(jax.nn.softmax(logits[0]))
  order = np.argsort(-probs)
  nucleus = set(order[:np.searchsorted(np.cumsum(probs[order]), p) + 1].tolist())
  draws = jax.vmap(lambda k: sample(logits[:1], k, strategy="top_p", nucleus_p=p))(jax.random.split(key, 500))[:, 0]
  assert set(np.asarray(draws).tolist()) <= nucleus and len(set(np.asarray(draws).tolist())) > 1


# ---------------------------------------------------------------- the CLI


def _cli(*args, timeout=240):
  env = dict(os.environ)
  env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
  env["JAX_PLATFORMS"] = "cpu"
  return subprocess.run([sys.executable, os.path.join(REPO_ROOT, "MaxText", "decode.py"), "configs/base.yml", *args],
                        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _rows(stdout):
  stops = dict(re.findall(r"^row (\d+): stop=(\S+)", stdout, re.M))
  ids = {int(i): [int(x) for x in v.split(",") if x] for i, v in re.findall(r"^row (\d+) ids: ?(.*)$", stdout, re.M)}
  return stops, ids


@pytest.mark.slow
def test_cli_streams_text_with_a_sentencepiece_tokenizer():
  r = _cli(f"tokenizer_path={DATA}/tokenizer.model", "prompt=I love to", "max_target_length=24",
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
  r = _cli("tokenizer_type=hf", f"tokenizer_path={DATA}/tokenizer.json", "prompt=The sea|I love to eat fish",
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
  r = _cli(f"load_parameters_path={path}", "prompt=1,17,42|1,99,7,8,9", "max_target_length=20",
           "max_prefill_length=8")
  assert r.returncode == 0, r.stderr
  assert f"load_parameters_path={path}" in r.stdout and "RANDOM" not in r.stdout
  _, ids = _rows(r.stdout)
  want = Engine(cfg, graphdef, params, buffers).generate([[1, 17, 42], [1, 99, 7, 8, 9]], eos_id=cfg.eos_id)
  assert [ids[0], ids[1]] == [g.tokens for g in want]


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
  r = _cli(*args, timeout=120)
  assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
  assert message in r.stderr, r.stderr
  assert "Traceback" not in r.stderr
