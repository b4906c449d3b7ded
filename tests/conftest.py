"""Test setup: 8 simulated CPU devices (set before jax is imported) and config helpers."""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# Tests are compile-bound (tiny shapes): LLVM -O0 compiles ~40% faster, and XLA:CPU's elemental
# emitters instead of its fusion emitters ~40% faster again (a serving engine's 9 step programs:
# 18.4 s -> 11.3 s), same results at the tests' tolerances. CLI subprocesses take the same flags
# (but test_multiprocess's: -O0 only, see there). jaxlib 0.11 knows no --xla_cpu_use_fusion_emitters (an unknown
# flag in XLA_FLAGS aborts the process when its first backend starts: the GPU image's jax 0.11.2 ran no test).
from importlib import metadata  # noqa: E402


def _jaxlib_version() -> tuple[int, ...]:
  return tuple(int(p) for p in metadata.version("jaxlib").split(".")[:2] if p.isdigit())


ELEMENTAL_EMITTERS = _jaxlib_version() < (0, 11)  # whether XLA:CPU still has them (and the flag)
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0" + (
    " --xla_cpu_use_fusion_emitters=false" if ELEMENTAL_EMITTERS else "")
for _flag in FAST_COMPILE_FLAGS.split():
  if _flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " " + _flag
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  # One persistent compilation cache per test session, shared by the xdist workers (they inherit
  # this environment from the controller) and the CLI subprocesses: many tests build the same
  # tiny programs afresh (new closures miss jit's in-memory cache, not this one).
  import tempfile
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="maxtext-test-jax-cache-")
  os.environ["MAXTEXT_TEST_CACHE_OWNER"] = str(os.getpid())

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
  sys.path.insert(0, REPO_ROOT)

import shutil  # noqa: E402

import pytest  # noqa: E402


def pytest_unconfigure(config):
  """The session's compilation cache goes with the process that made it (the xdist controller)."""
  if os.environ.get("MAXTEXT_TEST_CACHE_OWNER") == str(os.getpid()):
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


MAP_BUDGET = 0.5  # of the kernel's per-process limit on memory maps (vm.max_map_count, 65530 by default)


def memory_maps() -> tuple[int, int] | None:
  """(this process's memory maps, the kernel's limit on them), or None where /proc does not say (not Linux)."""
  try:
    with open("/proc/self/maps") as f:
      n = sum(1 for _ in f)
    with open("/proc/sys/vm/max_map_count") as f:
      return n, int(f.read())
  except OSError:
    return None


def release_programs_if_maps_above(fraction: float = MAP_BUDGET) -> bool:
  """Every XLA:CPU executable maps its code into the process (~3 maps a tiny program, more for a big one) and
  jit's caches keep every program a process compiled: a long xdist worker reached the kernel's limit
  (vm.max_map_count) near the end of the suite, and the next mmap failed inside XLA (a segfault or an abort in
  the persistent cache's executable.serialize, a different test each run). Above `fraction` of the limit:
  jax.clear_caches() and a collection, which unmap the programs nothing holds -> whether it released."""
  import gc

  got = memory_maps()
  if got is None or got[0] <= fraction * got[1]:
    return False
  import jax
  jax.clear_caches()
  gc.collect()
  return True


@pytest.fixture(scope="module", autouse=True)
def _program_maps():
  """After each test module: its programs released if the process's memory maps passed MAP_BUDGET of the
  limit (release_programs_if_maps_above); a module's own programs stay cached while it runs."""
  yield
  release_programs_if_maps_above()


@pytest.fixture(autouse=True)
def _kernel_row():
  """MAXTEXT_TEST_KERNEL_ROW=gpu (or tpu) runs each test with that backend's row of
  MaxText/kernels/backend.py: on the CPU, the kernels a GPU or TPU would run (pytest -m device)."""
  row = os.environ.get("MAXTEXT_TEST_KERNEL_ROW")
  if not row:
    yield
    return
  from MaxText.kernels import backend
  with backend.forced(row):
    yield


def make_config(**overrides):
  """The tiny model's config on a single-device mesh (tests that want a mesh set ici_* keys)."""
  from MaxText.config import pyconfig
  overrides.setdefault("ici_data_parallelism", 1)
  return pyconfig.initialize(["test", "base.yml"], num_devices=overrides.pop("num_devices", 1), **overrides)


@pytest.fixture
def production_emitters(monkeypatch):
  """Programs compiled in the test take XLA:CPU's default (fusion) emitters, not FAST_COMPILE_FLAGS':
  for tests that read the compiled HLO's structure (in-place updates, copies) as users get it."""
  import jax

  if not ELEMENTAL_EMITTERS:  # the fusion emitters are all this jaxlib has
    return
  compile_ = jax.stages.Lowered.compile

  def compile_with_fusion_emitters(self, compiler_options=None, **kw):
    return compile_(self, {"xla_cpu_use_fusion_emitters": True, **(compiler_options or {})}, **kw)

  monkeypatch.setattr(jax.stages.Lowered, "compile", compile_with_fusion_emitters)


@pytest.fixture
def tiny_config():
  return make_config


# What a checkpoint read left running prints when it ends late (issue 46: checkpoint/read_scope.py).
READ_NOISE = ("Traceback", "Exception ignored", "Event loop is closed", "never retrieved", "destroyed but it is pending")


def read_noise(said: str) -> list[str]:
  return [n for n in READ_NOISE if n in said]


@pytest.fixture
def said(capfd, caplog, monkeypatch):
  """-> collect(): what the process said outside return values since the last call: stdout and stderr (at the
  file descriptors, so also what TensorStore's threads print), logging (asyncio's 'never retrieved'), and
  exceptions ignored (sys.unraisablehook, threading.excepthook), after the garbage left behind is freed."""
  import gc
  import logging
  import threading
  import time
  ignored = []
  monkeypatch.setattr(sys, "unraisablehook", lambda u: ignored.append(f"Exception ignored in: {u.object!r}: "
                                                                       f"{u.exc_value!r}"))
  monkeypatch.setattr(threading, "excepthook", lambda a: ignored.append(f"Traceback (thread): {a.exc_value!r}"))
  caplog.set_level(logging.WARNING, logger="asyncio")

  def collect() -> str:
    time.sleep(0.05)  # abandoned reads end late: TensorStore completes them, then the collector frees them
    gc.collect()
    out, err = capfd.readouterr()
    text = "\n".join([out, err, caplog.text, *ignored])
    ignored.clear()
    caplog.clear()
    return text

  return collect


@pytest.fixture
def lingering_reads(monkeypatch):
  """Each array read of a checkpoint that succeeds lingers 0.1 s before it returns: when one read fails, its
  siblings are surely still in flight (the race of issue 46, made certain). Patches orbax 0.12.8's
  serialization._read_shard (the TensorStore read of one shard), called by name for every shard."""
  import asyncio

  from orbax.checkpoint._src.serialization import serialization
  read = serialization._read_shard

  async def lingering(*args, **kwargs):
    shard = await read(*args, **kwargs)
    await asyncio.sleep(0.1)
    return shard

  monkeypatch.setattr(serialization, "_read_shard", lingering)


_INTEGRATION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "integration") + os.sep


def pytest_collection_modifyitems(config, items):
  """Every end-to-end test (tests/integration/) is `slow`: the fast lane, `pytest tests -m "not slow" -n 2`
  (README.md), runs the unit tests not marked slow; CI runs everything. One rule instead of a marker a file."""
  for item in items:
    if str(item.path).startswith(_INTEGRATION):
      item.add_marker(pytest.mark.slow)
