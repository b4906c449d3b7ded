"""runtime/distributed: which rows of the global batch each process loads (`batch_rows`,
`batch_slice`) on meshes whose data, fsdp, expert and context axes span processes, and the start-up
rendezvous alone (no jax.distributed) in subprocesses: it lets a run start only with every process.

The processes are pretended: process p of P owns devices [p*8/P, (p+1)*8/P) of the 8 simulated
CPU devices (jax.devices() order, as jax.distributed numbers them), and a sharding's
`addressable_devices_indices_map` keeps only those."""

import os
import socket
import subprocess
import sys

import jax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from MaxText.runtime import distributed, sharding
from tests.conftest import REPO_ROOT, make_config


def _as_process(monkeypatch, pid: int, processes: int):
  per = len(jax.devices()) // processes
  mine = {d for d in jax.devices() if d.id // per == pid}
  monkeypatch.setattr(NamedSharding, "addressable_devices_indices_map",
                      lambda self, shape: {d: i for d, i in self.devices_indices_map(shape).items() if d in mine})


# mesh -> processes -> (index, count) of each process: it loads rows [index * B/count, (index+1) * B/count)
ROWS = [
    (dict(ici_data_parallelism=8), 2, [(0, 2), (1, 2)]),
    (dict(ici_data_parallelism=8), 4, [(0, 4), (1, 4), (2, 4), (3, 4)]),
    (dict(ici_fsdp_parallelism=2, ici_expert_parallelism=4), 2, [(0, 2), (1, 2)]),  # fsdp spans the processes
    (dict(ici_expert_parallelism=8), 4, [(0, 4), (1, 4), (2, 4), (3, 4)]),  # expert spans them
    (dict(ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_expert_parallelism=2), 4,
     [(0, 4), (1, 4), (2, 4), (3, 4)]),
    # each row's tokens over context: processes 0, 1 share rows [0, B/2) and 2, 3 rows [B/2, B)
    (dict(ici_data_parallelism=2, ici_context_parallelism=2, ici_expert_parallelism=2), 4,
     [(0, 2), (0, 2), (1, 2), (1, 2)]),
    (dict(ici_data_parallelism=1, ici_tensor_parallelism=8), 2, [(0, 1), (0, 1)]),  # rows not split: all load all
]


@pytest.mark.parametrize("mesh,processes,want", ROWS,
                         ids=lambda v: "x".join(f"{k[4:-12]}{n}" for k, n in v.items()) if isinstance(v, dict) else None)
def test_each_process_loads_the_rows_its_devices_hold(mesh, processes, want, monkeypatch):
  cfg = make_config(num_devices=8, global_batch_size=16, **mesh)
  device_mesh = sharding.create_mesh(cfg)
  spec = sharding.logical_to_spec(("activation_batch",), sharding.rules_of(cfg), device_mesh, (16,))
  held = NamedSharding(device_mesh, spec).devices_indices_map((16,))  # device -> its slice of the rows
  for pid in range(processes):
    _as_process(monkeypatch, pid, processes)
    got = distributed.batch_rows(cfg, device_mesh)
    assert (got["process_index"], got["process_count"]) == want[pid], pid
    index, count = want[pid]
    rows = set().union(*(range(16)[s[0]] for d, s in held.items() if d.id // (8 // processes) == pid))
    assert rows == set(range(index * 16 // count, (index + 1) * 16 // count))  # what its devices hold


def test_rows_held_apart_are_refused_naming_the_mesh_order(monkeypatch):
  cfg = make_config(num_devices=8, global_batch_size=16, ici_data_parallelism=8)
  _as_process(monkeypatch, 0, 2)  # devices 0-3
  for order in [(0, 4, 1, 5, 2, 6, 3, 7),  # interleaved with process 1's: row blocks 0, 2, 4, 6 of 8
                (0, 1, 2, 4, 5, 6, 7, 3)]:  # rows 0-5 and 14-15: a gap, though the span is the whole batch
    device_mesh = sharding.create_mesh(cfg, [jax.devices()[i] for i in order])
    with pytest.raises(ValueError, match="not one contiguous block.*order the mesh"):
      distributed.batch_slice(NamedSharding(device_mesh, PartitionSpec("data")), (16, 32))


# ---------------------------------------------------------------- the start-up rendezvous, alone

_RENDEZVOUS = """
import sys
from MaxText.config.types import ConfigError
from MaxText.runtime import distributed
try:
  distributed._rendezvous(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
  print("ok")
except ConfigError as e:
  print("error:", e)
"""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _rendezvous(processes: int, pids, timeout_s: float) -> list[str]:
  """What each of `pids` (of `processes`) says after the rendezvous: "ok" or "error: ..."."""
  address = f"localhost:{_free_port()}"
  env = {**os.environ, "PYTHONPATH": REPO_ROOT}
  procs = [subprocess.Popen([sys.executable, "-c", _RENDEZVOUS, address, str(processes), str(pid), str(timeout_s)],
                            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for pid in pids]
  try:
    out = [p.communicate(timeout=30) for p in procs]
  finally:
    for p in procs:
      p.kill()  # no-op once exited; a hung one fails the test, not CI
  assert all(p.returncode == 0 for p in procs), [e for _, e in out]
  return [o.strip() for o, _ in out]


def test_rendezvous_starts_only_when_every_process_came():
  # 2 of 3 came: process 0 must not let them start; it names the missing one, to both
  said = _rendezvous(3, [0, 1], timeout_s=1.5)
  assert said[0].startswith("error: distributed_num_processes=3: process(es) [2] did not reach"), said
  assert said[1].startswith("error: distributed_num_processes=3"), said  # process 0's line, or its own timeout
  assert _rendezvous(2, [0, 1], timeout_s=10) == ["ok", "ok"]



def test_process_allgather_on_one_process_stacks_or_keeps_the_rows_and_settled_returns_its_tree():
  import jax.numpy as jnp
  import numpy as np

  from MaxText.runtime.distributed import process_allgather, settled
  assert process_allgather(np.array([3, 4])).tolist() == [[3, 4]]  # stacked: [processes, ...]
  assert process_allgather(np.array([3, 4]), tiled=True).tolist() == [3, 4]
  assert process_allgather(np.int32(5)).tolist() == [5]
  tree = {"a": jnp.ones(3)}
  assert settled(tree) is tree


def test_from_host_copy_places_each_devices_block_of_the_host_value():
  """Every device holds exactly its block of the whole host copy (rows over data, the rest replicated), as
  jax.device_put would place it; on several processes each places only its own devices' blocks."""
  import numpy as np
  mesh = jax.make_mesh((4, 2), ("data", "tensor"))
  tokens = np.arange(8 * 3, dtype=np.int32).reshape(8, 3)
  scores = np.linspace(0, 1, 8, dtype=np.float32)
  shardings = {"tokens": NamedSharding(mesh, PartitionSpec("data", None)),
               "scores": NamedSharding(mesh, PartitionSpec())}
  got = distributed.from_host_copy({"tokens": tokens, "scores": scores}, shardings)
  for k, want in (("tokens", tokens), ("scores", scores)):
    assert got[k].sharding == shardings[k] and got[k].dtype == want.dtype
    for shard in got[k].addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
  assert got["tokens"].addressable_shards[0].data.shape == (2, 3)  # a block, not the whole
