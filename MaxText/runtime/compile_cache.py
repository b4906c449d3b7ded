"""JAX's persistent compilation cache for every entry point that compiles (train, decode, serve):
a program compiled once is read back from disk by the next process that builds it, so a second start
of the same server, or a resumed run, skips XLA's compile.

Where it lives: `jax_cache_dir` (MaxText's key; `~` expanded; "" turns the cache off), unless the
environment sets JAX_COMPILATION_CACHE_DIR, which wins (the tests point every process of a session
at one folder that way). Every program is cached, however fast it compiled (serving compiles many
small step programs, each under JAX's default 1 s threshold), unless the environment sets
JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS. Clearing it is deleting the folder; entries are keyed by
the program, the jax/XLA version and the devices, so a stale entry is never used, only left behind.
"""

from __future__ import annotations

import os

from MaxText.config.types import Config

DIR_ENV = "JAX_COMPILATION_CACHE_DIR"
MIN_TIME_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"


def folder(config: Config) -> str:
  """The cache folder this process uses ("" = none): the environment's, else jax_cache_dir's."""
  return os.environ.get(DIR_ENV) or (os.path.expanduser(config.jax_cache_dir) if config.jax_cache_dir else "")


def enable(config: Config) -> str:
  """Points JAX at the cache folder (before the first compile) -> that folder ("" when off)."""
  import jax
  path = folder(config)
  if path:
    jax.config.update("jax_compilation_cache_dir", path)
    if MIN_TIME_ENV not in os.environ:
      jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  return path
