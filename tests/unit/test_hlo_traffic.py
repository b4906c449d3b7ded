"""aot.collective_traffic: what one device sends per collective in a compiled program, loop bodies counted by
their trip counts (XLA's cost analysis counts a scan's body once); train_compile's step estimate, and its one line
when the compiler refuses a step larger than the chip."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from MaxText.runtime import aot


def _compiled_text(fn, mesh, spec, shape):
  x = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))
  return jax.jit(fn).lower(x).compile().as_text()


@pytest.mark.parametrize("steps", [1, 5])
def test_all_reduce_in_a_scan_counts_once_per_iteration(steps):
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(4), ("d",))

  @jax.shard_map(mesh=mesh, in_specs=P("d"), out_specs=P("d"))
  def fn(x):  # x: [8, 16] a device
    def body(c, _):
      return c * 0.5 + jax.lax.psum(jnp.sin(c), "d"), None
    return jax.lax.scan(body, x, None, length=steps)[0]

  got = aot.collective_traffic(_compiled_text(fn, mesh, P("d"), (32, 16)), 4)
  assert got["all-reduce"]["count"] == steps
  assert got["all-reduce"]["bytes"] == pytest.approx(steps * 2 * (8 * 16 * 4) * 3 / 4)  # ring: 2(n-1)/n
  assert "loops_without_trip_count" not in got


def test_all_gather_over_one_mesh_axis_uses_that_axis_group():
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))

  @jax.shard_map(mesh=mesh, in_specs=P("a", "b"), out_specs=P("a", None), check_vma=False)
  def fn(x):  # x: [4, 8] a device; gathered over b (4 devices): [4, 32]
    def body(c, _):
      return c + jnp.sum(jax.lax.all_gather(c, "b", axis=1, tiled=True), axis=1, keepdims=True), None
    return jax.lax.all_gather(jax.lax.scan(body, x, None, length=3)[0], "b", axis=1, tiled=True)

  got = aot.collective_traffic(_compiled_text(fn, mesh, P("a", "b"), (8, 32)), 8)
  assert got["all-gather"]["count"] == 4  # 3 in the loop, 1 after
  assert got["all-gather"]["bytes"] == pytest.approx(4 * (4 * 32 * 4) * 3 / 4)  # (n-1)/n of the gathered result


def test_group_sizes_and_ring_bytes_of_each_form():
  line = "  %r = f32[8]{0} reduce-scatter(%x), replica_groups={{0,1},{2,3}}, dimensions={0}"
  assert aot._bytes_moved("reduce-scatter", line, 4) == 32 * 1  # (n-1) x the scattered result, n = 2
  line = "  %g = bf16[16,4]{1,0} all-gather(%x), replica_groups=[2,4]<=[8], dimensions={0}"
  assert aot._bytes_moved("all-gather", line, 8) == 128 * 3 / 4
  line = "  %g = bf16[16,4]{1,0} all-to-all(%x), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, dimensions={0}"
  assert aot._bytes_moved("all-to-all", line, 8) == 128 * 3 / 4
  line = "  %g = (bf16[4,4]{1,0}, bf16[16,4]{1,0}) all-gather-start(%x), replica_groups=[2,4]<=[8], dimensions={0}"
  assert aot._bytes_moved("all-gather", line, 8) == 128 * 3 / 4  # the operand in the tuple is not sent twice
  line = "  %p = (f32[4]{0}, f32[4]{0}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%x), source_target_pairs={{0,1}}"
  assert aot._bytes_moved("collective-permute", line, 8) == 16
  line = "  %a = f32[10]{0} all-reduce(%x), replica_groups={}, to_apply=%add"
  assert aot._bytes_moved("all-reduce", line, 5) == 2 * 40 * 4 / 5  # empty groups: every device


def test_a_loop_of_another_form_counts_once_and_is_reported():
  hlo = "\n".join([
      "%cond (p: (s32[], f32[4])) -> pred[] {",
      "  %p = (s32[], f32[4]) parameter(0)",
      "  ROOT %c = pred[] custom-call(%p), custom_call_target=\"x\"",
      "}",
      "%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {",
      "  %a = f32[4]{0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%add",
      "}",
      "ENTRY %main (x: f32[4]) -> f32[4] {",
      "  %w = (s32[], f32[4]) while(%t), condition=%cond, body=%body",
      "}"])
  got = aot.collective_traffic(hlo, 2)
  assert got["all-reduce"] == {"count": 1, "bytes": 16.0}
  assert got["loops_without_trip_count"]["count"] == 1


def _report(devices=8, sent=2e9):
  return {"total_parameters": 10**9, "tokens_per_step": 8 * 4096, "num_devices": devices,
          "collective_traffic": {"all-reduce": {"count": 3, "bytes": sent},
                                 "loops_without_trip_count": {"count": 1, "bytes": 0.0}}}


def test_step_estimate_from_model_flops_and_ring_bandwidth(tiny_config):
  from MaxText import train, train_compile
  from MaxText.runtime import metrics
  config = tiny_config(remat_policy="none")
  est = train_compile.step_estimate(config, _report(), "TPU v5")
  flops = metrics.model_flops_per_token(config, train.active_params(config, 10**9)) * 8 * 4096 / 8
  assert est["compute_s"] == pytest.approx(flops / 459e12)
  assert est["collectives_s"] == pytest.approx(2e9 / 200e9)
  assert est["full_overlap_s"] == max(est["compute_s"], est["collectives_s"])
  assert est["no_overlap_s"] == pytest.approx(est["compute_s"] + est["collectives_s"])
  remat = train_compile.step_estimate(tiny_config(remat_policy="full"), _report(), "TPU v5")
  assert remat["compute_s"] == pytest.approx(est["compute_s"] * 4 / 3)  # the forward again
  staged = tiny_config(remat_policy="none", ici_pipeline_parallelism=3, num_pipeline_microbatches=4, num_devices=3)
  piped = train_compile.step_estimate(staged, _report(), "TPU v5")
  assert piped["bubble"] == pytest.approx(2 / 6)  # (S-1)/(M+S-1)
  assert piped["compute_s"] == pytest.approx(est["compute_s"] * 3 / 2)


@pytest.mark.parametrize("kind", ["cpu", "TPU v5 lite", "NVIDIA H100 80GB HBM3"])
def test_no_step_estimate_without_both_tables(tiny_config, kind):
  from MaxText import train_compile
  assert train_compile.step_estimate(tiny_config(), _report(), kind) is None


def test_a_topology_compile_traces_the_kernels_with_its_platforms_choices():
  from types import SimpleNamespace

  from MaxText import train_compile
  from MaxText.kernels import backend
  with train_compile.traced_for([SimpleNamespace(platform="tpu")]):
    assert backend.choices() == backend.row("tpu")
  with train_compile.traced_for(None):  # virtual CPU devices: this process's row
    assert backend.choices() == backend.row(jax.default_backend())
  assert backend.row("tpu") != backend.row("cpu")  # the test would not see a missing switch otherwise


def test_a_step_the_compiler_finds_larger_than_the_chip_is_one_line_and_exit_1(monkeypatch, capsys):
  """The TPU compiler refuses a step over the chip's HBM (RESOURCE_EXHAUSTED) before any memory analysis:
  train_compile says so in one line on stderr and exits 1, as a peak over compile_hbm_gib does; another compile
  error still raises."""
  from MaxText import train_compile
  msg = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (136.73G) "
         "exceeds available HBM (95.74G).\nwhat follows: the largest buffers")

  def refused(config, devices):
    raise jax.errors.JaxRuntimeError(msg)
  monkeypatch.setattr(train_compile, "compile_train_step", refused)
  with pytest.raises(SystemExit) as exit_:
    train_compile.compile_or_exit(None, jax.devices()[:1])
  assert exit_.value.code == 1
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "136.73G" in err and "Traceback" not in err
  assert err.startswith(f"error: the train step does not fit a {jax.devices()[0].device_kind}'s memory: ")

  def broken(config, devices):
    raise jax.errors.JaxRuntimeError("INVALID_ARGUMENT: something else")
  monkeypatch.setattr(train_compile, "compile_train_step", broken)
  with pytest.raises(jax.errors.JaxRuntimeError, match="INVALID_ARGUMENT"):
    train_compile.compile_or_exit(None, jax.devices()[:1])
