"""Our jitted forward vs Hugging Face's DeepseekV32ForCausalLM (torch, CPU) on the same weights.

    .venv/bin/python benchmarks/forward.py [--seqs 1024 4096] [--repeats 3]

A tiny-but-wide DeepSeek-V3.2 (1 dense + 1 MoE layer, indexer top-k 256) is built in HF with
random weights, converted with MaxText.convert_hf_checkpoint, and both forwards are timed side
by side in one run (median of --repeats after a warm-up; jit compile time excluded).
"""

import argparse
import os
import tempfile
import time

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from MaxText.checkpoint import (
  hf_import,  # noqa: E402
  model_state,
)


def hf_config(topk):
  return transformers.DeepseekV32Config(
      vocab_size=2048, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=2,
      first_k_dense_replace=1, num_attention_heads=8, num_key_value_heads=8, n_shared_experts=1,
      n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, kv_lora_rank=128, q_lora_rank=256,
      qk_rope_head_dim=32, v_head_dim=64, qk_nope_head_dim=64, index_topk=topk, index_head_dim=64,
      index_n_heads=16, max_position_embeddings=8192, initializer_range=0.05,
      rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                       "original_max_position_embeddings": 2048, "beta_fast": 32.0, "beta_slow": 1.0,
                       "mscale": 1.0, "mscale_all_dim": 1.0})


def median_time(fn, repeats):
  fn()
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return float(np.median(times)) * 1e3


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096])
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--topk", type=int, default=256)
  args = ap.parse_args()
  torch.manual_seed(0)
  hf = transformers.DeepseekV32ForCausalLM(hf_config(args.topk)).eval()
  hf.set_attn_implementation("eager")
  with tempfile.TemporaryDirectory() as d:
    hf.save_pretrained(os.path.join(d, "hf"))
    out = os.path.join(d, "maxtext")
    cfg = hf_import.convert_checkpoint(os.path.join(d, "hf"), out)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1, 1, 1), cfg.mesh_axes)
    graphdef, params, buffers, _ = model_state.load_parameters(out, cfg, mesh)
  fwd = jax.jit(lambda p, b, x: model_state.merge(graphdef, p, b)(x)[0])
  print(f"torch threads {torch.get_num_threads()}, jax devices {jax.devices()}")
  print(f"{'seq':>6} {'ours ms':>10} {'HF ms':>10} {'HF/ours':>8} {'rel err':>9}")
  for s in args.seqs:
    tokens = np.random.default_rng(0).integers(3, 2048, size=(1, s))
    x = jnp.asarray(tokens)
    ours = lambda: fwd(params, buffers, x).block_until_ready()
    with torch.no_grad():
      tt = torch.as_tensor(tokens)
      theirs = lambda: hf(tt).logits
      ms_ours, ms_hf = median_time(ours, args.repeats), median_time(theirs, args.repeats)
      a, b = np.asarray(fwd(params, buffers, x)), theirs().numpy()
      rel = float(np.linalg.norm(a - b) / np.linalg.norm(b))
    print(f"{s:>6} {ms_ours:>10.1f} {ms_hf:>10.1f} {ms_hf / ms_ours:>8.2f} {rel:>9.1e}", flush=True)


if __name__ == "__main__":
  main()
