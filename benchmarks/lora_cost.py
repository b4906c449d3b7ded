"""What each LoRA module choice costs on the 671B model: trained parameters, their memory with AdamW's two
moments, and the adapters' forward matmul FLOPs per token over the base's. From the abstract model (nothing
allocated); prints a table, then one JSON line.

    python benchmarks/lora_cost.py [--rank 64] [--model deepseek3.2-671b]

QLoRA's train state per device (base / adapters / optimizer): `python -m MaxText.train_compile` (docs/lora.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flax import nnx  # noqa: E402

from MaxText import train  # noqa: E402
from MaxText.checkpoint import model_state  # noqa: E402
from MaxText.config import pyconfig  # noqa: E402
from MaxText.layers import lora  # noqa: E402
from MaxText.layers.models import Transformer  # noqa: E402

ATTENTION = ".*/attention/(wq_a|wq_b|wq|wkv_a|wkv_b|wo)"
MLPS = ".*/mlp(/shared_experts)?/(gate|up|down)"
EXPERTS = ".*/mlp/(wi_0|wi_1|wo)"  # the routed experts, as per-expert adapters
CHOICES = {  # None: base.yml's lora_module_path (the default modules); "+X": the default and X
    "default (MLA q/kv/o + dense and shared MLPs + indexer wq_b, wk, weights_proj)": None,
    "the default without the indexer's weights_proj": f"{ATTENTION}|{MLPS}|.*/indexer/(wq_b|wk)",
    "MLA q/kv/o only": ATTENTION,
    "dense + shared-expert MLPs only": MLPS,
    "routed experts only (per-expert adapters)": EXPERTS,
    "default + routed experts": "+" + EXPERTS,
}

def cost(model_name: str, rank: int, path: str | None) -> dict:
  keys = dict(model_name=model_name, lora_rank=rank, ici_data_parallelism=1)
  base = pyconfig.initialize(["lora_cost", "base.yml"], num_devices=1, **keys)
  if path is None or path.startswith("+"):
    path = base.lora_module_path + ("|" + path[1:] if path else "")
  cfg = base.model_copy(update={"lora_module_path": path})
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  adapters = lora.split(nnx.split(model, nnx.Param, ...)[1].to_pure_dict())[0]
  n = model_state.count_params(adapters)
  flops = 0
  for _, m in lora.matched(model, cfg):
    *stack, n_in, n_out = m.kernel.shape
    flops += 2 * rank * (n_in + n_out) * (stack[0] if stack else 1)
  for _, moe, name in lora.matched_experts(model, cfg):  # a token runs num_experts_per_tok experts' adapters
    *stack, _, n_in, n_out = getattr(moe, name).shape  # [L, E, in, out]
    flops += 2 * rank * (n_in + n_out) * cfg.num_experts_per_tok * (stack[0] if stack else 1)
  total = model_state.count_params(model_state.abstract_model(cfg.model_copy(update={"lora_rank": 0}))[1])
  base_flops = 2 * train.active_params(cfg, total)  # forward: 2 per active parameter
  return {"lora_module_path": path, "trained_parameters": n, "adapter_and_adam_gib": 12 * n / 2**30,
          "forward_flops_fraction": flops / base_flops}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--rank", type=int, default=64)
  ap.add_argument("--model", default="deepseek3.2-671b")
  args = ap.parse_args()
  rows = {name: cost(args.model, args.rank, path) for name, path in CHOICES.items()}
  print(f"{args.model}, lora_rank={args.rank}")
  print(f"{'modules':48} {'trained params':>16} {'adapters+AdamW':>15} {'+fwd FLOPs':>11}")
  for name, r in rows.items():
    print(f"{name:48} {r['trained_parameters']:>16,} {r['adapter_and_adam_gib']:>11.2f} GiB "
          f"{100 * r['forward_flops_fraction']:>10.2f}%")
  print(json.dumps({"model": args.model, "rank": args.rank, "rows": rows}))


if __name__ == "__main__":
  main()
