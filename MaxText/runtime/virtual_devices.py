"""Virtual CPU devices for ahead-of-time compiles (train_compile, serve_compile): the device count
comes from the merged config's compile_num_devices and must be set before jax is imported, so this
module imports no jax."""

from __future__ import annotations

import os
import sys

# An XLA:CPU rewrite a GPU/TPU compile never makes, off for both compile tools' virtual-device compiles:
# XLA:CPU has no bf16 or fp8 matmul: it converts a dot's operands up (bf16 -> f32, e4m3 -> f16), and its
# while-loop invariant code motion then hoists that convert of the stacked weights out of the layer loop:
# a wider copy of every layer's weights at once (the serving step's 671B experts: 183 -> 14 GiB of
# temporaries; the QLoRA train step's fp8 experts: an f16 copy, 2 bytes a weight, 190 -> see docs/lora.md).
CPU_OPTIONS = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}  # as jax's compile(compiler_options)
CPU_FLAGS = tuple(f"--{k}={v}" for k, v in CPU_OPTIONS.items())  # as XLA_FLAGS


def num_devices_or_exit(argv) -> int:
  """compile_num_devices from the merged config (0: leave the devices as they are); a config mistake
  is one line and exit 2."""
  from MaxText.config import pyconfig
  from MaxText.config.types import ConfigError
  try:
    n = pyconfig.merged_values(argv).get("compile_num_devices", 0)
  except ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    sys.exit(2)
  if not isinstance(n, int) or n < 0:
    print(f"config error: config key 'compile_num_devices' = {n!r}: a device count >= 0", file=sys.stderr)
    sys.exit(2)
  return n


def use_virtual_devices(n: int, extra_flags: tuple[str, ...] = ()) -> None:
  """n virtual CPU devices for this process (XLA_FLAGS, plus extra_flags); before jax is imported."""
  if "jax" in sys.modules:
    raise RuntimeError("the virtual device count must be set before jax is imported")
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
  os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}", *extra_flags])
  os.environ["JAX_PLATFORMS"] = "cpu"


def setup_or_exit(argv, topology: bool = True) -> list | None:
  """For a compile entry point's main, the devices to compile for: a TPU topology's (aot.topology_devices) when
  the merged config names compile_topology (topology=False: the entry point has none, exit 2 in one line);
  else None, after setting compile_num_devices virtual devices (with CPU_FLAGS) when it is > 0."""
  from MaxText.config import pyconfig
  from MaxText.config.types import ConfigError
  try:
    name = pyconfig.merged_values(argv).get("compile_topology", "")
  except ConfigError:
    name = ""  # num_devices_or_exit says what is wrong, in one line
  if name:
    if not topology:
      print(f"config error: compile_topology={name!r}: only MaxText.train_compile compiles for a TPU topology; "
            "here use compile_num_devices", file=sys.stderr)
      sys.exit(2)
    from MaxText.runtime import aot
    try:
      return aot.topology_devices(name)
    except ValueError as e:
      print(f"config error: compile_topology={name!r}: {e}", file=sys.stderr)
      sys.exit(2)
  n = num_devices_or_exit(argv)
  if n:
    use_virtual_devices(n, CPU_FLAGS)
  return None
