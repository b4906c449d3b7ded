"""runtime/distributed's start and end of a process: which runs start jax.distributed
(`initialize`, with JAX's cluster detectors faked) and that an entry point's process exits once
its main has returned, whatever threads or native teardown would hold it (`run_main`)."""

import subprocess
import sys
import textwrap
import time

import jax
import pytest
from jax._src import clusters

from MaxText.config.types import ConfigError, Distributed
from MaxText.runtime import distributed
from tests.conftest import REPO_ROOT


class _Env:
  """A cluster environment as jax's detectors are: present, and naming `count` processes (or failing)."""
  opt_in_only_method = False

  def __init__(self, count):
    self.count = count
    self.__name__ = "FakeTpuCluster"

  def is_env_present(self):
    return True

  def get_process_count(self):
    if isinstance(self.count, Exception):
      raise self.count
    return self.count


def _keys(n=-1, pid=-1, address=""):
  return Distributed(distributed_coordinator_address=address, distributed_num_processes=n,
                     distributed_process_id=pid, distributed_initialization_timeout=5)


@pytest.fixture
def started(monkeypatch):
  """Each call jax.distributed.initialize would get (nothing is started); an env var or a detector
  the host has is taken away."""
  calls = []
  monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
  monkeypatch.setattr(clusters.ClusterEnv, "_cluster_types", [])
  monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
  return calls


def _detected(monkeypatch, count):
  monkeypatch.setattr(clusters.ClusterEnv, "_cluster_types", [_Env(count)])


def test_nothing_detected_is_one_process(started):
  assert distributed.initialize(_keys()) == jax.device_count()
  assert started == []


@pytest.mark.parametrize("keys", [_keys(n=1), _keys(n=1, pid=0), _keys(n=1, pid=0, address="localhost:1")])
def test_one_process_asked_for_starts_nothing_even_in_a_detected_environment(started, monkeypatch, keys):
  _detected(monkeypatch, ConnectionError("metadata.google.internal: Name or service not known"))
  assert distributed.initialize(keys) == jax.device_count()
  assert started == []


def test_an_environment_naming_one_process_starts_nothing(started, monkeypatch):
  _detected(monkeypatch, 1)
  assert distributed.initialize(_keys()) == jax.device_count()
  assert started == []


class _TpuEnv(_Env):
  """jax's TPU clusters: the slice's hosts from an environment variable (GKE) or the metadata server, the
  slices' count from the metadata server unless MEGASCALE_NUM_SLICES is set."""

  def __init__(self, hosts):
    super().__init__(ConnectionError("tpu-env: metadata.google.internal unreachable"))
    self.hosts = hosts

  def _get_worker_list_in_slice(self):
    return self.hosts


@pytest.mark.parametrize("hosts,slices,starts", [(["localhost"], None, False), (["localhost"], "2", True),
                                                 (["h0", "h1"], None, True)])
def test_a_tpu_slice_of_one_host_is_one_process_without_the_metadata_server(started, monkeypatch, hosts, slices,
                                                                            starts):
  """The lent v5e host: a TPU environment naming one host, no metadata server (its probe of the slices fails)."""
  monkeypatch.setattr(clusters.ClusterEnv, "_cluster_types", [_TpuEnv(hosts)])
  if slices is None:
    monkeypatch.delenv("MEGASCALE_NUM_SLICES", raising=False)
  else:
    monkeypatch.setenv("MEGASCALE_NUM_SLICES", slices)
  distributed.initialize(_keys())
  assert bool(started) == starts


def test_an_environment_naming_several_processes_starts_jax_distributed_from_it(started, monkeypatch):
  _detected(monkeypatch, 2)
  distributed.initialize(_keys())
  assert started == [((), dict(num_processes=None, process_id=None, initialization_timeout=5))]


def test_a_failed_probe_is_one_line_naming_the_keys(started, monkeypatch):
  _detected(monkeypatch, ConnectionError("HTTPConnectionPool(host='metadata.google.internal')\nmore"))
  with pytest.raises(ConfigError) as e:
    distributed.initialize(_keys())
  msg = str(e.value)
  assert "\n" not in msg and "FakeTpuCluster" in msg and "ConnectionError" in msg
  assert "distributed_num_processes=1" in msg and "distributed_coordinator_address" in msg
  assert started == []


def test_a_failed_bootstrap_is_one_line_naming_the_keys(started, monkeypatch):
  _detected(monkeypatch, 4)

  def fail(*a, **k):
    raise RuntimeError("tpu-env: Failed to resolve 'metadata.google.internal'\ntraceback...")
  monkeypatch.setattr(jax.distributed, "initialize", fail)
  with pytest.raises(ConfigError) as e:
    distributed.initialize(_keys())
  assert "\n" not in str(e.value) and "distributed_num_processes=1" in str(e.value)


def test_several_processes_without_an_address_or_environment_are_refused(started):
  with pytest.raises(ConfigError, match="distributed_coordinator_address"):
    distributed.initialize(_keys(n=2, pid=0))


# ---------------------------------------------------------------- the end of a process

_HELD = textwrap.dedent("""
  import sys, threading, time
  from MaxText.runtime import distributed
  def main(argv):
    threading.Thread(target=time.sleep, args=(3600,), daemon=False).start()  # holds a normal exit
    print("done: " + argv[1], flush=False)  # still buffered when main returns
    if argv[1] == "fail":
      sys.exit(3)
  distributed.run_main(main, sys.argv)
""")


@pytest.mark.parametrize("outcome,code", [("ok", 0), ("fail", 3)])
def test_an_entry_point_exits_when_its_main_returns_with_its_code_and_its_output(outcome, code):
  """A process whose main has returned exits at once with main's code and everything it printed,
  though a non-daemon thread (or a runtime's teardown: the TPU's held train.py 60+ s) would hold it."""
  t0 = time.monotonic()
  p = subprocess.run([sys.executable, "-c", _HELD, outcome], cwd=REPO_ROOT, capture_output=True, text=True,
                     timeout=60)
  assert (p.returncode, p.stdout) == (code, f"done: {outcome}\n"), p.stderr
  assert time.monotonic() - t0 < 30  # the import of jax and MaxText alone; the thread sleeps an hour
