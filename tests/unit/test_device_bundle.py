"""tools/device/device_bundle.sh without the network: the accelerator image plus the bundle cover every
third-party import of what the device check runs, and a bad --bundle folder is one clear line. The bundle
itself is built and installed offline by hand (docs/accelerators.md: it needs PyPI)."""

import ast
import importlib.metadata
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# What the device check runs: the package, the unit tests it collects, its own scripts.
DEVICE_CODE = ["MaxText", "tests/unit", "tests/conftest.py", "tools/device/device_check.py",
               "benchmarks/indexer_topk.py", "benchmarks/decode.py", "benchmarks/serving.py", "benchmarks/long_context.py",
               "benchmarks/sparse_mla_kernel.py", "benchmarks/profile_ops.py", "benchmarks/train_mfu.py"]
# Imported only off the device, lazily: the torch oracle (its tests skip without it), HF datasets pipelines,
# lm-evaluation-harness (server/lm_eval_client.run_lm_eval: an integration test and a benchmark).
OFF_DEVICE = {"torch", "transformers", "datasets", "lm_eval"}


def _canon(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def _imports(path: str) -> set[str]:
  """The top-level names of a file's absolute imports, wherever they stand (lazy ones too)."""
  names = set()
  for node in ast.walk(ast.parse(open(path).read(), path)):
    if isinstance(node, ast.Import):
      names |= {a.name.split(".")[0] for a in node.names}
    elif isinstance(node, ast.ImportFrom) and not node.level:
      names.add(node.module.split(".")[0])
  return names


def _files() -> list[str]:
  out = []
  for p in DEVICE_CODE:
    full = os.path.join(REPO, p)
    if full.endswith(".py"):
      out.append(full)
    for root, _, names in os.walk(full):
      out += [os.path.join(root, n) for n in names if n.endswith(".py")]
  return out


def test_the_image_and_the_bundle_cover_every_import_of_the_device_check():
  files = _files()
  local = {os.path.splitext(os.path.basename(f))[0] for f in files} | {"MaxText", "tests", "benchmarks", "demos"}
  third_party = set().union(*map(_imports, files)) - set(sys.stdlib_module_names) - local - OFF_DEVICE
  image = {_canon(re.split(r"[=<> ;#]", ln, maxsplit=1)[0])
           for ln in open(os.path.join(REPO, "tools/device/device_image.txt")) if ln.strip() and not ln.startswith("#")}
  script = open(os.path.join(REPO, "tools/device/device_bundle.sh")).read()
  needs = {_canon(n) for n in re.search(r"^NEEDS=\((.*)\)$", script, re.M).group(1).split()}
  dists = importlib.metadata.packages_distributions()
  missing = {m: dists.get(m) for m in third_party if not {_canon(d) for d in dists.get(m, [m])} & (image | needs)}
  assert not missing, (f"imported by what runs on the device, on neither the image (tools/device/device_image.txt) "
                       f"nor in the bundle (NEEDS in tools/device/device_bundle.sh): {missing}")


def _check(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run(["bash", os.path.join(REPO, "tools/device/device_check.sh"), *args], capture_output=True,
                        text=True, timeout=30)


def test_a_bundle_folder_without_wheels_says_how_to_make_one(tmp_path):
  p = _check("--bundle", str(tmp_path), "--only", "selection")
  assert p.returncode == 2 and p.stdout == ""
  assert p.stderr.strip() == (f"device_bundle.sh: no wheels in {tmp_path}; make them with: "
                              f"bash tools/device/device_bundle.sh {tmp_path}")
  p = _check("--bundle")
  assert p.returncode == 2 and "--bundle needs a folder" in p.stderr and len(p.stderr.splitlines()) == 1
