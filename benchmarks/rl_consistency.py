"""RL consistency: how far the trainer's log-probs of the engine's sampled tokens are from the engine's own,
with and without keep routing and the keep sampling mask.

    python benchmarks/rl_consistency.py                               # one device, f32, the tiny model
    python benchmarks/rl_consistency.py --devices 8                   # data 2 x expert 4 (simulated CPUs)
    python benchmarks/rl_consistency.py dtype=bfloat16 weight_dtype=bfloat16   # any config key=value

Prints per way (keep routing x sampling mask) the max and mean |trainer - engine|, the moved policy's kept-set
gap and how often the trainer's routing differs from the engine's; then one JSON line. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

MOVE = 0.05  # the moved policy's relative weight noise
WAYS = {(True, True): "keep_routing_and_mask", (False, True): "mask_only", (True, False): "keep_routing_only",
        (False, False): "neither"}  # (keep routing, sampling mask): the JSON's name

def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--devices", type=int, default=1, help="1, or 8: data 2 x expert 4 on simulated CPU devices")
  p.add_argument("--prompts", type=int, default=8)
  p.add_argument("--group", type=int, default=4, help="samples per prompt (they share the prompt's pages)")
  p.add_argument("--new", type=int, default=24, help="tokens generated per sample")
  p.add_argument("--prompt-len", type=int, default=20)
  args, overrides = p.parse_known_args(argv)
  if args.devices > 1:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
  import jax

  from MaxText.checkpoint import model_state
  from MaxText.config import pyconfig
  from MaxText.inference.scheduler import SamplingParams
  from MaxText.inference.serving import ServingEngine
  from MaxText.post_train.policy_logprobs import logprobs_of, rollout_arrays
  from MaxText.runtime import sharding

  length = args.prompt_len + args.new
  keys = dict(max_target_length=length, max_prefill_length=length, indexer_topk=length, param_init_std=0.2,
              mtp_num_layers=0, serve_page_size=4, serve_max_num_seqs=16, serve_max_num_tokens=128,
              prefill_chunk_size=32, moe_capacity_factor=-1.0, matmul_precision="highest", remat_policy="none",
              ici_data_parallelism=2 if args.devices > 1 else 1, ici_expert_parallelism=max(1, args.devices // 2))
  keys |= dict(kv.split("=", 1) for kv in overrides)
  cfg = pyconfig.initialize(["bench", "base.yml"], num_devices=args.devices, **keys)
  mesh = sharding.create_mesh(cfg)
  rng = np.random.default_rng(0)
  options = [dict(), dict(top_p=0.8), dict(), dict(top_k=20), dict(top_p=0.9, top_k=50)]
  with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    graphdef, params, buffers, _ = model_state.create(cfg, mesh)
    eng = ServingEngine(cfg, graphdef, params, buffers, eos_id=-1)
    prompts = [[1] + rng.integers(2, cfg.vocab_size, args.prompt_len - 1).tolist() for _ in range(args.prompts)]
    params_of = lambda g, i: SamplingParams(max_tokens=args.new, temperature=1.0, seed=1000 * g + i, rollout=True,  # noqa: E731
                                            **options[(g + i) % len(options)])
    requests = [eng.add_request(prompts[g], params_of(g, 0)) for g in range(args.prompts)]
    while any(r.prefilling for r in requests):
      eng.step()
    requests += [eng.add_request(prompts[g], params_of(g, i)) for g in range(args.prompts) for i in range(1, args.group)]
    while not eng.idle:
      eng.step()
    a = rollout_arrays(requests, length, cfg.vocab_size, cfg.num_moe_layers, cfg.num_experts_per_tok)

    @jax.jit
    def forward(p, tokens, positions, seg, routed):
      logits, aux = model_state.merge(graphdef, p, buffers)(tokens, positions, seg, routed_experts=routed)
      return logits, aux["routed_experts"]  # [N,T,V], [N,T,L,k]

    def scored(routed, masked, p=params, ids=True):
      logits, chosen = forward(p, a["tokens"], a["positions"], a["segment_ids"], routed)
      return np.asarray(logprobs_of(logits, a["tokens"], temperature=1.0, kept=a["kept"] if masked else None,
                                    kept_ids=a["kept_ids"] if masked and ids else None)), chosen

    free = forward(params, a["tokens"], a["positions"], a["segment_ids"], None)[1]  # the trainer's own routing
    results = {}
    for keep_routing in (True, False):
      routed = a["routed_experts"] if keep_routing else np.full_like(a["routed_experts"], -1)  # -1: route freely
      for masked in (True, False):
        logp, _ = scored(routed, masked)
        d = np.abs(logp - a["logp_old"])[a["generated"]]
        results[(keep_routing, masked)] = (float(d.max()), float(d.mean()))
    # a moved policy (weights x (1 + MOVE N(0, 1)), as after an update): the engine's recorded kept ids vs the
    # set rebuilt as the n largest of the moved logits, over the filtered tokens whose set was recorded as ids
    leaves, tree = jax.tree.flatten(params)
    noise = [np.random.default_rng(i).standard_normal(x.shape) for i, x in enumerate(leaves)]
    moved = jax.tree.unflatten(tree, [(x * (1 + MOVE * n)).astype(x.dtype) for x, n in zip(leaves, noise)])
    recorded = (a["kept_ids"][..., 0] >= 0) & (a["kept"] < cfg.vocab_size) & a["generated"]  # [N,T]
    gap = np.abs(scored(a["routed_experts"], True, moved)[0] - scored(a["routed_experts"], True, moved, ids=False)[0])
    g = gap[recorded] if recorded.any() else np.zeros(1)  # none: no top-k row (or every set past KEPT_IDS)
    moved_gap = (float(g.max()), float(g.mean()), float((g > 1e-4).mean()))

  rec, own = a["routed_experts"], np.sort(np.asarray(free), -1)
  computed = rec[..., 0, 0] >= 0  # [N,T] positions the engine fed through the model
  differs = (np.sort(rec, -1) != own).any(-1)[computed]  # [positions, L]
  per_layer = float(differs.mean()) if differs.size else 0.0
  per_token = float(differs.any(-1).mean()) if differs.size else 0.0
  print(f"\n{len(requests)} rollouts ({args.prompts} prompts x {args.group}), {int(a['generated'].sum())} sampled "
        f"tokens, {int(computed.sum())} routed positions x {cfg.num_moe_layers} MoE layers; {cfg.dtype}, "
        f"{args.devices} device(s); prefix hit rate {eng.allocator.hit_rate():.2f}")
  print("\n| keep routing | sampling mask | max abs diff | mean abs diff |\n|---|---|---|---|")
  for (kr, m), (mx, mean) in results.items():
    print(f"| {'on' if kr else 'off'} | {'on' if m else 'off'} | {mx:.2e} | {mean:.2e} |")
  print(f"\nmoved policy (weights x (1 + {MOVE} N(0,1))), {int(recorded.sum())} filtered tokens: |engine's "
        f"kept ids - the rebuilt n largest| max {moved_gap[0]:.3e}, mean {moved_gap[1]:.3e}, "
        f"{moved_gap[2]:.1%} of tokens differ by > 1e-4")
  print(f"\nrouting (trainer's own vs the engine's): {per_layer:.4%} of (position, MoE layer) pairs differ; "
        f"{per_token:.4%} of positions differ in some layer")
  print(json.dumps({"devices": args.devices, "dtype": cfg.dtype, "rollouts": len(requests),
                    "sampled_tokens": int(a["generated"].sum()),
                    **{f"max_abs_diff_{way}": results[k][0] for k, way in WAYS.items()},
                    "mean_abs_diff_mask_only": results[(False, True)][1],
                    "moved_ids_vs_rebuilt_max": moved_gap[0], "moved_ids_vs_rebuilt_mean": moved_gap[1],
                    "moved_ids_vs_rebuilt_fraction": moved_gap[2], "routing_differs_per_layer": per_layer,
                    "routing_differs_per_position": per_token}))


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  main()
