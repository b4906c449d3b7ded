"""What each LoRA module choice costs on the 671B model: trained parameters, their memory with AdamW's two
moments, and the adapters' forward matmul FLOPs per token over the base's. From the abstract model (nothing
allocated); prints a table, then one JSON line.

    python benchmarks/lora_cost.py [--rank 64] [--model deepseek3.2-671b] [--state]

--state adds QLoRA's train state per device (base / adapters / optimizer) on 8 and 16 devices.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if "--state" in sys.argv:
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=16"
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
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


def state_per_device(model_name: str, rank: int) -> list[dict]:
  import jax

  from MaxText.checkpoint import orbax_state
  from MaxText.runtime import aot, sharding
  rows = []
  for n, extra in ((8, {}), (16, {"ici_fsdp_parallelism": 2})):
    cfg = pyconfig.initialize(["lora_cost", "base.yml"], num_devices=n, model_name=model_name, ici_data_parallelism=1,
                              ici_expert_parallelism=8, max_target_length=4096, weight_quantization="fp8_block",
                              lora_rank=rank, global_batch_size=n, **extra)
    mesh = sharding.create_mesh(cfg, jax.devices()[:n])
    with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
      state, _, _ = train.abstract_train_step(cfg, mesh)
    gib = lambda t: aot.bytes_per_device(t) / 2**30  # noqa: E731
    rows.append({"devices": n, "base_gib": gib(state[orbax_state.FROZEN]), "adapters_gib": gib(state["params"]),
                 "optimizer_gib": gib(state["opt_state"])})
  return rows


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--rank", type=int, default=64)
  ap.add_argument("--model", default="deepseek3.2-671b")
  ap.add_argument("--state", action="store_true", help="also the QLoRA train state per device on 8 and 16 devices")
  args = ap.parse_args()
  rows = {name: cost(args.model, args.rank, path) for name, path in CHOICES.items()}
  print(f"{args.model}, lora_rank={args.rank}")
  print(f"{'modules':48} {'trained params':>16} {'adapters+AdamW':>15} {'+fwd FLOPs':>11}")
  for name, r in rows.items():
    print(f"{name:48} {r['trained_parameters']:>16,} {r['adapter_and_adam_gib']:>11.2f} GiB "
          f"{100 * r['forward_flops_fraction']:>10.2f}%")
  state = state_per_device(args.model, args.rank) if args.state else []
  if state:
    print(f"QLoRA train state per device (fp8 base, default modules), GiB\n{'devices':>8} {'base':>8} {'adapters':>9} "
          f"{'AdamW':>7}")
    for r in state:
      print(f"{r['devices']:>8} {r['base_gib']:>8.2f} {r['adapters_gib']:>9.3f} {r['optimizer_gib']:>7.3f}")
  print(json.dumps({"model": args.model, "rank": args.rank, "rows": rows, "state": state}))


if __name__ == "__main__":
  main()
