"""Train-step MFU of a DeepSeek-V3.2-shaped model that fits one device, and the step's profile.

    python benchmarks/train_mfu.py                                  # configs/models/deepseek3.2-v5e.yml
    python benchmarks/train_mfu.py --set remat_policy=full global_batch_size=4
    python benchmarks/train_mfu.py --force mask_attention=xla      # the XLA mask path beside the tpu row's splash

The step is the device check's (compiled from abstract inputs, its memory checked before anything is allocated);
each --set is one rung, the first that fits is run. Prints the median step time, model MFU
(metrics.model_flops_per_token) and compiled MFU (cost analysis) against the bf16 peak, then the profile per
part, source line and op (profile_ops), then one JSON line. Asserts nothing about time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tools", "device")]
import device_check  # noqa: E402  (tools/device/device_check.py: the train step, compiled, fitted, timed)

from benchmarks import profile_ops, timing  # noqa: E402
from MaxText.kernels import backend  # noqa: E402

PARTS = (  # (part, file suffix or suffixes, functions or None): the first match over an op's MaxText frames
    ("attention: indexer", ("layers/indexer.py", "kernels/index_scores.py"), None),
    ("attention: selection", ("kernels/selection.py", "kernels/selection_keys.py", "kernels/topk_indices.py"), None),
    ("attention: sparse core", "kernels/sparse_attention.py", None),
    ("attention: masks", "kernels/masks.py", None),
    ("MoE: dispatch", "kernels/moe_dispatch.py", None),
    ("MoE: experts", "kernels/moe_experts.py", None),
    ("MoE: router, shared", "layers/moe.py", None),
    ("attention: flash kernel", "kernels/flash_attention.py", None),
    ("attention: KL target kernel", "kernels/kl_target.py", None),
    ("attention: MLA", "layers/attention_mla.py", None),
    ("embeddings, RoPE", "layers/embeddings.py", None),
    ("norms", "layers/normalizations.py", None),
    ("linears", ("layers/linears.py", "kernels/fp8_blocks.py"), None),
    ("optimizer", "runtime/optimizers.py", None),
    ("loss", "MaxText/train.py", None),
)


def main(argv: list[str] | None = None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="deepseek3.2-v5e", help="model_name (configs/models/<name>.yml)")
  ap.add_argument("--steps", type=int, default=5)
  ap.add_argument("--out", default="/tmp/train_mfu", help="where the trace goes")
  ap.add_argument("--no-trace", action="store_true")
  ap.add_argument("--top", type=int, default=25)
  ap.add_argument("--compile-only", action="store_true", help="each rung's compiled memory alone")
  args, force = timing.parse(ap, argv, "overrides of one rung; repeat --set for further rungs (largest first)", True)
  tried = []
  for rung in args.set or [[]]:
    overrides = dict(model_name=args.model, **timing.overrides(rung))
    with backend.forced(**force):
      r = device_check.train_step(overrides, args.steps, None if args.no_trace else args.out, args.compile_only)
    if args.compile_only:
      print(json.dumps(dict(benchmark="train_mfu", model=args.model, overrides=rung, compile_only=True, **r)), flush=True)
      continue
    if r["fits"]:
      break
    tried.append(f"{' '.join(rung) or '(the model as configured)'}: {r.get('peak_gib')} GiB > {r.get('limit_gib')} GiB")
    print(f"does not fit: {tried[-1]}", flush=True)
  else:
    if not args.compile_only:
      print(json.dumps(dict(benchmark="train_mfu", model=args.model, fits=False, tried=tried)))
    return
  hlo = r.pop("hlo", None)
  print(f"model {args.model} {' '.join(rung)}: {r['params'] / 1e9:.3f}B parameters, {r['tokens']} tokens a step, "
        f"peak memory {r['peak_gib']} GiB of {r['limit_gib']}; compile {r['compile_s']} s")
  print(f"step {r['step_ms']:.1f} ms (median of {args.steps}); model MFU {r['model_mfu']:.1%}, compiled "
        f"{r['tflops_per_s']} TFLOP/s = {r['mfu']:.1%} of {r['peak_tflops']} TFLOP/s ({r['peak_source']}); loss {r['loss']}")
  parts = None if hlo is None else profile_ops.summarize(args.out, [hlo], PARTS, 2, args.top)
  print(json.dumps(dict(benchmark="train_mfu", model=args.model, overrides=rung, forced=args.force, tried=tried,
                        parts=parts, **r)))


if __name__ == "__main__":
  main()
