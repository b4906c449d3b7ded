"""decode.py as a user runs it (test_decode.py, test_fp8_weights.py)."""

import os
import re
import subprocess
import sys

from tests.conftest import REPO_ROOT


def decode_cli(*args, timeout=240):
  """python MaxText/decode.py configs/base.yml *args on the CPU (one device), from the repository root."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
  env["JAX_PLATFORMS"] = "cpu"
  return subprocess.run([sys.executable, os.path.join(REPO_ROOT, "MaxText", "decode.py"), "configs/base.yml", *args],
                        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
