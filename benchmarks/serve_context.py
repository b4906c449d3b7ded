r"""What a serving context costs to compile: the engine's step programs and the seconds its warmup takes
(every program compiled once, JAX's persistent cache off), for the tiny base.yml model at a few
max_target_length and bucket settings. docs/serving_a_run.md reads it to pick a context.

    PYTHONPATH=. .venv/bin/python benchmarks/serve_context.py [key=value ...]   # extra keys: every row

Prints a table and one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROWS = {  # name: overrides (the cheapest first: each row prints as it ends)
    "1024, 4 seqs, 1 width, 1 context": {"max_target_length": 1024, "serve_max_num_seqs": 4,
                                         "serve_width_buckets": 1, "serve_context_buckets": 1},
    "64 (a small run's context)": {"max_target_length": 64},
    "1024": {"max_target_length": 1024},
}


def main(extra: list[str]) -> None:
  import jax

  from MaxText.checkpoint import model_state
  from MaxText.config import pyconfig
  from MaxText.inference.serving import ServingEngine
  from MaxText.runtime import sharding
  jax.config.update("jax_enable_compilation_cache", False)
  out = {}
  print("| context | step programs | warmup s |\n| --- | --- | --- |")
  for name, keys in ROWS.items():
    argv = ["serve_context", "configs/base.yml", *[f"{k}={v}" for k, v in keys.items()], *extra]
    config = pyconfig.initialize(argv, jax_cache_dir="")
    mesh = sharding.create_mesh(config)
    with jax.set_mesh(mesh), sharding.logical_rules(config, mesh):
      graphdef, params, buffers, _ = model_state.create(config, mesh)
      engine = ServingEngine(config, graphdef, params, buffers)
      t = time.perf_counter()
      n = engine.warmup()
      seconds = time.perf_counter() - t
    out[name] = {"programs": n, "warmup_s": round(seconds, 1)}
    print(f"| {name} | {n} | {seconds:.1f} |", flush=True)
  print(json.dumps(out))


if __name__ == "__main__":
  main(sys.argv[1:])
