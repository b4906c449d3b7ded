"""runtime/compile_cache: the persistent compilation cache's folder is jax_cache_dir (`~` expanded, ""
= off) unless JAX_COMPILATION_CACHE_DIR is set, which wins; enabling it caches every program unless
JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says otherwise."""

import os

import jax

from MaxText.runtime import compile_cache
from tests.conftest import make_config


def _enabled(monkeypatch, env: dict, **keys) -> tuple[str, dict]:
  for k in (compile_cache.DIR_ENV, compile_cache.MIN_TIME_ENV):
    monkeypatch.delenv(k, raising=False)
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  updates = {}
  monkeypatch.setattr(jax.config, "update", lambda name, value: updates.__setitem__(name, value))
  return compile_cache.enable(make_config(**keys)), updates


def test_the_key_names_the_folder_the_environment_wins_and_empty_is_off(monkeypatch, tmp_path):
  path, updates = _enabled(monkeypatch, {}, jax_cache_dir="~/some/cache")
  assert path == os.path.expanduser("~/some/cache") != "~/some/cache"
  assert updates == {"jax_compilation_cache_dir": path, "jax_persistent_cache_min_compile_time_secs": 0.0}
  path, updates = _enabled(monkeypatch, {compile_cache.DIR_ENV: str(tmp_path)}, jax_cache_dir="~/some/cache")
  assert path == str(tmp_path) and updates["jax_compilation_cache_dir"] == str(tmp_path)
  path, updates = _enabled(monkeypatch, {compile_cache.MIN_TIME_ENV: "2"}, jax_cache_dir="/x")
  assert path == "/x" and updates == {"jax_compilation_cache_dir": "/x"}  # the environment's threshold stays
  assert _enabled(monkeypatch, {}, jax_cache_dir="") == ("", {})


def test_the_environment_beside_the_key_at_its_boundaries(monkeypatch, tmp_path):
  """The environment's folder wins over jax_cache_dir="" (off) too; an empty variable is unset (the key's
  folder); a threshold of "0" in the environment is a setting, left alone."""
  path, updates = _enabled(monkeypatch, {compile_cache.DIR_ENV: str(tmp_path)}, jax_cache_dir="")
  assert path == str(tmp_path) and updates["jax_compilation_cache_dir"] == str(tmp_path)
  assert compile_cache.folder(make_config(jax_cache_dir="")) == str(tmp_path)
  path, _ = _enabled(monkeypatch, {compile_cache.DIR_ENV: ""}, jax_cache_dir="/x")
  assert path == "/x"
  assert _enabled(monkeypatch, {compile_cache.DIR_ENV: ""}, jax_cache_dir="") == ("", {})
  path, updates = _enabled(monkeypatch, {compile_cache.MIN_TIME_ENV: "0"}, jax_cache_dir="/x")
  assert updates == {"jax_compilation_cache_dir": "/x"}


def test_a_long_test_process_releases_its_programs_before_the_memory_map_limit():
  """tests/conftest.py's guard against the kernel's per-process memory-map limit (the crash it prevents: a long
  xdist worker's mmap failing inside XLA): below the budget nothing is released (jit keeps its programs);
  above it the programs nothing holds are unmapped (jax.clear_caches and a collection). A program of many
  kernels maps its code in pieces (~90 maps for 60 dots here; a test of the model ~150-700)."""
  import jax
  import jax.numpy as jnp
  import pytest

  from tests import conftest

  if conftest.memory_maps() is None:
    pytest.skip("no /proc/self/maps here")

  def chain(a, i):  # 60 dots and cumsums: kernels that do not fuse into one
    for k in range(60):
      a = jnp.tanh(a @ a.T + i + k) * jnp.cumsum(a, axis=k % 2)
    return a.sum()

  before = conftest.memory_maps()[0]
  fns = [jax.jit(lambda a, i=i: chain(a, i)) for i in range(3)]  # held, as a library's jitted functions are
  for fn in fns:
    fn(jnp.ones((16, 16))).block_until_ready()
  compiled = conftest.memory_maps()[0]
  assert compiled > before + 100, (before, compiled)  # the programs' code is mapped
  assert not conftest.release_programs_if_maps_above(1.0)  # under the limit: kept
  kept = conftest.memory_maps()[0]
  assert kept > before + 100, (before, kept)
  assert conftest.release_programs_if_maps_above(0.0)  # over the budget: released
  assert conftest.memory_maps()[0] < kept - 100
