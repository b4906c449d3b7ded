"""benchmarks/profile_ops.py's reading of a program compiled for a TPU (decode_profile.py --compile-for), on a
synthetic HLO text (CI has no libtpu), and its one line where no TPU compiler is at hand."""

from benchmarks import profile_ops

HLO = """HloModule jit_step

%fused_computation.1 (param_0: f32[4096,1024]) -> f32[4096,1024] {
  %param_0 = f32[4096,1024]{1,0:T(8,128)} parameter(0)
  ROOT %broadcast.9 = f32[4096,1024]{1,0:T(8,128)} broadcast(%param_0), dimensions={0,1}
}

%bitcast_fusion (bitcast_input: u32[8]) -> u32[8] {
  ROOT %copy.8 = u32[4096,1024]{1,0} copy(%bitcast_input)
}

ENTRY %main.1 (x.1: f32[4096,1024]) -> f32[4096,1024] {
  %x.1 = f32[4096,1024]{1,0:T(8,128)} parameter(0)
  %copy.3 = f32[1024,4096]{0,1:T(8,128)} copy(%x.1), backend_config={"window_config":{"estimated_cycles":"3000"}}
  %broadcast.4 = bf16[1000,1000]{1,0} broadcast(%x.1), dimensions={}
  %pad.5 = s32[2000,1000]{1,0} pad(%x.1, %c), padding=0_0x0_1
  ROOT %fusion.2 = f32[4096,1024]{1,0:T(8,128)} fusion(%copy.3), kind=kLoop, calls=%fused_computation.1, backend_config={"window_config":{"estimated_cycles":"1500"}}
}
"""


def test_materialized_lists_the_unfused_whole_array_writes_at_or_above_the_floor():
  rows = profile_ops.materialized(HLO, 2_000_000)
  # copy.3 (16.8 MB) and pad.5 (8 MB, at the floor's side of 2 MB); broadcast.4 is 2 MB: listed too (>=); the
  # broadcast and copy inside fused computations are not HBM writes; the fusion is not a materializing kind
  assert [(r["op"], r["kind"], r["mb"]) for r in rows] == [("copy.3", "copy", 16.78), ("pad.5", "pad", 8.0),
                                                           ("broadcast.4", "broadcast", 2.0)]
  assert rows[0]["shape"] == "f32[1024,4096]" and rows[0]["layout"] == "{0,1:T(8,128)}"
  assert [r["op"] for r in profile_ops.materialized(HLO, 2_000_001)] == ["copy.3", "pad.5"]


def test_estimated_ns_reads_each_ops_cycles_at_the_clock():
  assert profile_ops.estimated_ns(HLO, 1.5) == {"copy.3": 2000.0, "fusion.2": 1000.0}


def test_no_tpu_compiler_is_one_line_not_a_traceback(capsys):
  assert profile_ops.topology_devices("nope:1x1") is None
  out = capsys.readouterr().out
  assert out.count("\n") == 1 and "decode_profile --compile-for: no TPU compiler for topology 'nope:1x1'" in out
  assert "pip install --target DIR libtpu" in out


LOOPED = """HloModule jit_step

%inner.7 (p: f32[64]) -> f32[64] {
  %p = f32[64]{0} parameter(0)
  ROOT %copy.71 = f32[4096,1024]{0,1} copy(%p)
}

%body.5 (t: (s32[], f32[64])) -> (s32[], f32[64]) {
  %t = (s32[], f32[64]) parameter(0)
  %copy.51 = f32[4096,1024]{0,1} copy(%t)
  %call.52 = f32[64]{0} call(%t), to_apply=%inner.7
  ROOT %tuple.53 = (s32[], f32[64]) tuple(%t, %call.52)
}

%cond.6 (t: (s32[], f32[64])) -> pred[] {
  %t = (s32[], f32[64]) parameter(0)
  ROOT %lt.61 = pred[] compare(%t, %t), direction=LT
}

ENTRY %main.1 (x.1: f32[4096,1024]) -> f32[4096,1024] {
  %x.1 = f32[4096,1024]{1,0} parameter(0)
  %copy.3 = f32[1024,4096]{0,1} copy(%x.1)
  %while.4 = (s32[], f32[64]) while(%x.1), condition=%cond.6, body=%body.5
  ROOT %copy.9 = f32[4096,1024]{1,0} copy(%while.4)
}
"""


def test_materialized_marks_the_writes_a_while_loop_repeats():
  # a scanned stack's layer loop: a whole-array write in its body (or in what the body calls) runs once a layer,
  # L times a step (the O(L^2) relayout of a stacked pool found at 8 layers, docs/kernels.md); the entry's, once
  rows = {r["op"]: r["in_loop"] for r in profile_ops.materialized(LOOPED, 1_000_000)}
  assert rows == {"copy.51": True, "copy.71": True, "copy.3": False, "copy.9": False}
