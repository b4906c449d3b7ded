"""What serving LoRA adapters per row costs (serve_lora_adapters; layers/lora_rows.py): the engine's greedy
throughput over the same base weights, in one process: the base alone; N adapter slots, every request through
none; the same engine, requests cycling through none and each adapter (one batch, one program).

    PYTHONPATH=. .venv/bin/python benchmarks/lora_serving.py [--adapters 4] [--rank 16] [--requests 8] \
        [--tokens 32] [--repeats 5] [key=value ...]   (model keys, default the tiny model)

Prints the median of --repeats interleaved rounds per row, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import timing  # noqa: E402
from MaxText.checkpoint import lora_adapters, model_state  # noqa: E402
from MaxText.config import pyconfig  # noqa: E402
from MaxText.inference.scheduler import SamplingParams  # noqa: E402
from MaxText.inference.serving import ServingEngine  # noqa: E402
from MaxText.layers import lora  # noqa: E402
from MaxText.runtime import sharding  # noqa: E402


def _random_adapter(cfg, name: str, rank: int, seed: int) -> lora_adapters.Adapter:
  abstract = lora.split(model_state.abstract_model(cfg.model_copy(update={"lora_rank": rank}))[1].to_pure_dict())[0]
  rng = np.random.default_rng(seed)
  params = jax.tree.map(lambda s: (rng.standard_normal(s.shape) * 0.05).astype(np.float32), abstract)
  return lora_adapters.Adapter.of(name, "(random)", rank, 2.0 * rank, params)


def _tok_s(runs: dict, prompts, tokens: int, repeats: int) -> dict:
  """{row: tokens/s, median over `repeats`}; runs: {row: (engine, each prompt's adapter slot)}. One compiling run
  each, then the rows interleaved repeat by repeat (a shared host's load drifts over all of them alike)."""
  params = {name: [SamplingParams(max_tokens=tokens, lora_adapter=k) for k in slots] for name, (_, slots) in runs.items()}
  times, _ = timing.interleaved({name: lambda e=e, name=name: e.generate(prompts, params[name])
                                 for name, (e, _) in runs.items()}, repeats, warmup=0)  # the first call compiles
  return {name: len(prompts) * tokens / statistics.median(t) for name, t in times.items()}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--adapters", type=int, default=4)
  ap.add_argument("--rank", type=int, default=16)
  ap.add_argument("--requests", type=int, default=8)
  ap.add_argument("--prompt", type=int, default=16)
  ap.add_argument("--tokens", type=int, default=32)
  ap.add_argument("--repeats", type=int, default=5)
  args, keys = ap.parse_known_args()
  cfg = pyconfig.initialize(["lora_serving", "base.yml", *keys], num_devices=1, ici_data_parallelism=1,
                            serve_max_num_seqs=args.requests,
                            serve_max_num_tokens=max(256, args.requests * args.prompt))
  mesh = sharding.create_mesh(cfg)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, cfg.vocab_size, args.prompt).tolist() for _ in range(args.requests)]
  names = [f"a{i}" for i in range(1, args.adapters + 1)]
  serve_cfg = cfg.model_copy(update={"serve_lora_adapters": tuple(f"{n}=(random)" for n in names)})
  adapters = [_random_adapter(cfg, n, args.rank, i) for i, n in enumerate(names)]
  with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    graphdef, params, buffers, _ = model_state.create(cfg, mesh)
    base = ServingEngine(cfg, graphdef, params, buffers, eos_id=-1)
    served_cfg, slots = lora_adapters.slots_on_mesh(serve_cfg, adapters, mesh)
    served = ServingEngine(served_cfg, model_state.abstract_model(served_cfg)[0], lora.join(slots, params), buffers,
                           eos_id=-1)
    none = [0] * len(prompts)
    mixed = [i % (args.adapters + 1) for i in range(len(prompts))]
    rows = _tok_s({"base": (base, none), "slots, none": (served, none), "slots, mixed": (served, mixed)}, prompts,
                  args.tokens, args.repeats)
    programs = served.step_programs()
  print(f"{args.requests} requests x {args.tokens} tokens, {args.adapters} adapters of rank {args.rank} on "
        f"{cfg.model_name} ({served_cfg.lora_module_path.count('|') + 1} linears), median of {args.repeats}")
  print(f"{'engine':<14} {'tok/s':>9} {'vs base':>8}")
  for name, v in rows.items():
    print(f"{name:<14} {v:>9.1f} {v / rows['base']:>8.3f}")
  print(json.dumps({"adapters": args.adapters, "rank": args.rank, "tok_s_base": round(rows["base"], 1),
                    "tok_s_slots_none": round(rows["slots, none"], 1), "tok_s_slots_mixed": round(rows["slots, mixed"], 1),
                    "mixed_vs_base": round(rows["slots, mixed"] / rows["base"], 3), "served_step_programs": programs}))


if __name__ == "__main__":
  main()
