"""LoRA's bookkeeping, each piece alone and fast (the integration tests run them end to end, slowly): A's init bound
from the input side, the served adapter slots and their alpha / r, the base check on serve and on resume, lora_alpha
in lora_restore_path's comparison, the merged export's alpha / r (and what each merged format keeps of a small
adapter over an fp8 base), peft's rank and alpha patterns for the fused
gate_up adapter. Each test fails when its one piece is broken (planted one at a time: docs/lora.md, Tests)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText.checkpoint import hf_export, lora_adapters, model_state, orbax_state
from MaxText.config.types import ConfigError
from MaxText.kernels.fp8_blocks import BlockFP8, dequantize, quantize
from MaxText.layers import lora
from MaxText.layers.linears import MLP
from MaxText.layers.moe import DeepSeekMoE
from tests.conftest import make_config

RNG = np.random.default_rng(0)


def _normal(*shape) -> np.ndarray:
  return RNG.standard_normal(shape).astype(np.float32)


def test_a_is_uniform_within_one_over_sqrt_of_its_input_side_for_linears_and_routed_experts():
  cfg = make_config(lora_rank=4, lora_module_path="gate|down|wi_0|wo")
  mlp, moe = MLP(cfg, 128, rngs=nnx.Rngs(0)), DeepSeekMoE(cfg, rngs=nnx.Rngs(0))
  lora.add_adapters(mlp, cfg, nnx.Rngs(1))
  lora.add_adapters(moe, cfg, nnx.Rngs(1))
  for name, a, n_in in (("gate", mlp.gate.lora_a, 64), ("down", mlp.down.lora_a, 128),  # [in, r]: in < out, in > out
                        ("wi_0", moe.wi_0_lora.lora_a, 64), ("wo", moe.wo_lora.lora_a, 32)):  # [E, in, r]
    top = float(np.abs(np.asarray(a[...])).max())
    assert 0.9 / np.sqrt(n_in) < top <= 1 / np.sqrt(n_in), (name, top, 1 / np.sqrt(n_in))


def _adapter(name: str, rank: int, alpha: float, n_in: int = 6, n_out: int = 5, **kw) -> lora_adapters.Adapter:
  return lora_adapters.Adapter.of(name, f"/runs/{name}", rank, alpha,
                                  {"lin": {"lora_a": _normal(n_in, rank), "lora_b": _normal(rank, n_out)}}, **kw)


def test_served_slots_hold_adapter_k_in_slot_k_its_rank_padded_and_its_alpha_over_r_in_b():
  a, b = _adapter("a", 2, 8.0), _adapter("b", 4, 2.0)
  like = {"lin": {"lora_a": jax.ShapeDtypeStruct((3, 6, 4), np.float32),  # [n, in, R]
                  "lora_b": jax.ShapeDtypeStruct((3, 4, 5), np.float32)}}  # [n, R, out]
  got = lora_adapters.stacked([a, b], like)["lin"]
  assert not got["lora_a"][0].any() and not got["lora_b"][0].any()  # slot 0: no adapter
  for k, ad in ((1, a), (2, b)):
    la, lb = ad.leaves["lin/lora_a"], ad.leaves["lin/lora_b"]
    np.testing.assert_array_equal(got["lora_a"][k, :, :ad.rank], la)
    np.testing.assert_allclose(got["lora_b"][k, :ad.rank], lb * ad.alpha / ad.rank, rtol=1e-6)
    assert not got["lora_a"][k, :, ad.rank:].any() and not got["lora_b"][k, ad.rank:].any()  # the padding adds nothing
    # the slot's x A B is the adapter's x (alpha / r) A B
    np.testing.assert_allclose(got["lora_a"][k] @ got["lora_b"][k], ad.alpha / ad.rank * la @ lb, rtol=1e-5, atol=1e-6)


FROZEN = {"lin": {"kernel": np.arange(12, dtype=np.float32).reshape(3, 4)}}


def _record(frozen=None) -> dict:
  """A base record as a LoRA checkpoint holds it: of `frozen` (default: another base than FROZEN)."""
  frozen = {"lin": {"kernel": np.ones((3, 4), np.float32)}} if frozen is None else frozen
  return {"fingerprint": int(orbax_state.base_fingerprint(frozen)), "load_parameters_path": "/bases/b1"}


@pytest.mark.parametrize("same", [False, True])
def test_serving_an_adapter_over_another_base_is_refused_naming_the_entry(monkeypatch, same):
  cfg = make_config(serve_lora_adapters=["sql=/runs/sql"], load_parameters_path="/bases/b2")
  ad = _adapter("sql", 4, 8.0, base=_record(FROZEN if same else None))
  monkeypatch.setattr(lora_adapters, "read", lambda name, path, where="": ad)
  monkeypatch.setattr(lora_adapters, "slots_on_mesh", lambda config, adapters, mesh: (config, {}))
  monkeypatch.setattr(model_state, "load_or_create", lambda config, mesh, report=print: (None, FROZEN, {}, "base"))
  if same:
    assert "LoRA adapters sql (rank 4, alpha 8)" in lora_adapters.load_or_create(cfg, None)[-1]
    return
  with pytest.raises(ConfigError, match=r"load_parameters_path=/bases/b2 is not the base serve_lora_adapters entry "
                     r"sql=/runs/sql was trained over: load_parameters_path=/bases/b1"):
    lora_adapters.load_or_create(cfg, None)


def _resume_config(tmp_path, **kw):
  return make_config(lora_rank=4, base_output_directory=str(tmp_path), run_name="sft",
                     load_parameters_path="/bases/b2", **kw)


@pytest.mark.parametrize("same", [False, True])
def test_resuming_a_lora_run_over_another_base_is_refused(tmp_path, monkeypatch, same):
  cfg = _resume_config(tmp_path)
  monkeypatch.setattr(orbax_state, "latest_step_on_disk", lambda config: 3)
  monkeypatch.setattr(orbax_state, "step_base_record", lambda step_dir: _record(FROZEN if same else None))
  like = {"lin": {"lora_a": "fresh"}}
  if same:
    assert lora_adapters.restored(cfg, like, FROZEN, report=lambda s: None) is like
    return
  with pytest.raises(ConfigError, match=r"is not the base run_name=sft's checkpoint step 3 .* was trained over"):
    lora_adapters.restored(cfg, like, FROZEN)


@pytest.mark.parametrize("key,theirs", [("lora_alpha", 8.0), ("lora_rank", 2)])
def test_lora_restore_path_from_a_run_of_another_alpha_or_rank_is_refused_naming_the_key(tmp_path, monkeypatch, key,
                                                                                          theirs):
  cfg = _resume_config(tmp_path, lora_alpha=16.0, lora_restore_path="/runs/sft", enable_checkpointing=False)
  ad = _adapter("", 4, 16.0)
  setattr(ad, {"lora_alpha": "alpha", "lora_rank": "rank"}[key], theirs)
  monkeypatch.setattr(lora_adapters, "read", lambda name, path, where="": ad)
  with pytest.raises(ConfigError, match=f"lora_restore_path=/runs/sft: its run trained at {key}={theirs:g}, this "
                     f"config has {key}={getattr(cfg, key):g}: set {key}={theirs:g}"):
    lora_adapters.restored(cfg, {"lin": {"lora_a": None, "lora_b": None}}, FROZEN)


def _merged_export(monkeypatch, base: dict, adapters: dict, requantize: bool = True, **keys) -> dict:
  """hf_export.merged_parameters's params for a LoRA run of `adapters` over the base params `base` (no files)."""
  cfg = make_config(load_parameters_path="/bases/b1", scan_layers=False, **keys)
  monkeypatch.setattr(hf_export, "find_checkpoint", lambda path: path)
  monkeypatch.setattr(hf_export, "lora_adapters", lambda item: adapters)
  monkeypatch.setattr(hf_export, "unstacked_parameters", lambda item, c: {"params": base, "buffers": {}})
  monkeypatch.setattr(orbax_state, "step_base_record", lambda step_dir: None)
  return hf_export.merged_parameters("/runs/sft/checkpoints/4/state", cfg, requantize)["params"]


def test_the_merged_export_adds_alpha_over_r_times_a_b_to_the_base(monkeypatch):
  w, a, b = _normal(6, 5), _normal(6, 2), _normal(2, 5)
  got = _merged_export(monkeypatch, {"lin": {"kernel": w}}, {"lin": {"lora_a": a, "lora_b": b}}, lora_rank=2,
                       lora_alpha=6.0)["lin"]["kernel"]
  np.testing.assert_allclose(got, w + 3.0 * a @ b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt", ["merged", "merged-float"])
def test_over_an_fp8_base_merged_rounds_a_1pct_adapter_to_e4m3_and_merged_float_keeps_it(monkeypatch, fmt):
  """kept: the share of the adapter's effect on the weight that the written model has, <written - base written,
  delta> / <delta, delta>, base and merged both as the export writes them (e4m3 blocks, or bf16: --dtype's default).
  Measured (a [512, 512] weight, 128 x 128 blocks, rank 16): e4m3 keeps 0.08 / 0.37 / 0.95 of a 0.2% / 1% / 5%
  adapter, bf16 1.01 / 1.00 / 1.00 (unbiased: a weight's error is 105% / 24% / 5% of its delta, noise that the
  matmul's sums average)."""
  w = quantize(jnp.asarray(_normal(64, 64) * 0.02), (16, 16))
  a, b = _normal(64, 4), _normal(4, 64)
  w64 = np.asarray(dequantize(w), np.float64)
  b *= 0.01 * np.linalg.norm(w64) / np.linalg.norm(a @ b)  # (alpha / r) A B: 1% of W (alpha = r)
  base = {"lin": {"kernel": np.asarray(w.values), "kernel_scale": np.asarray(w.scale)}}
  got = _merged_export(monkeypatch, base, {"lin": {"lora_a": a, "lora_b": b}}, fmt == "merged",
                       lora_rank=4, lora_alpha=4.0, weight_block_size=(16, 16))["lin"]
  delta = np.asarray(a, np.float64) @ b
  if fmt == "merged":
    written = np.asarray(dequantize(BlockFP8(jnp.asarray(got["kernel"]), jnp.asarray(got["kernel_scale"]))), np.float64)
    base_written = w64
  else:
    assert "kernel_scale" not in got and got["kernel"].dtype == np.float32
    bf16 = lambda x: np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16), np.float64)  # noqa: E731
    written, base_written = bf16(got["kernel"]), bf16(w64)
  kept = float(np.sum((written - base_written) * delta) / np.sum(delta * delta))
  assert (kept < 0.6) if fmt == "merged" else (0.95 < kept < 1.05), (fmt, kept)


def test_peft_gives_the_fused_gate_up_adapter_rank_2r_and_alpha_2_alpha_so_its_delta_is_ours():
  """peft's ParamWrapper over transformers' gate_up_proj [E, 2I, D]: lora_A.weight [E R, D] read as (E, R, D),
  lora_B.weight [2I, R E] as (2I, R, E), expert e's delta (alpha' / R) B_e A_e with R, alpha' from rank_pattern /
  alpha_pattern (lora_rank / lora_alpha where the module has no entry): ours is alpha / r [A_g B_g | A_u B_u]^T."""
  e, d, i, r, alpha = 2, 6, 5, 3, 12.0
  cfg = make_config(lora_rank=r, lora_alpha=alpha)
  got = {n: (_normal(e, d, r), _normal(e, r, i)) for n in ("gate_proj", "up_proj")}  # A [E,D,r], B [E,r,I]
  module = "model.layers.1.mlp.experts"
  tensors, ranks = hf_export.peft_expert_tensors(module, got)
  conf = hf_export.peft_config(cfg, sorted(ranks), None, ranks)
  name = f"{module}.gate_up_proj"
  rank = conf["rank_pattern"].get(re.escape(name), conf["r"])
  scale = conf["alpha_pattern"].get(re.escape(name), conf["lora_alpha"]) / rank
  assert name in conf["target_parameters"]
  pa = tensors[f"{hf_export.PEFT_PREFIX}{module}.lora_A.weight"].reshape(e, rank, d)  # [E,R,D]
  pb = tensors[f"{hf_export.PEFT_PREFIX}{module}.lora_B.weight"].reshape(2 * i, rank, e)  # [2I,R,E]
  for x in range(e):
    theirs = scale * pb[:, :, x] @ pa[x]  # [2I, D]
    ours = alpha / r * np.concatenate([(got[n][0][x] @ got[n][1][x]).T for n in ("gate_proj", "up_proj")])  # [2I, D]
    np.testing.assert_allclose(theirs, ours, rtol=1e-5, atol=1e-5, err_msg=f"expert {x}")
