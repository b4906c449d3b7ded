"""The README and docs/ as a new user reads them: every relative link resolves, the documented commands'
config keys are valid, the cheap commands run as written, and the figures a command depends on (the chat
server's context, lm-eval's max_length, RL's console metrics) agree with the code. Fails when a doc rots."""

import glob
import json
import math
import os
import re
import shlex
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = ["README.md"] + sorted(os.path.relpath(p, REPO_ROOT) for p in glob.glob(os.path.join(REPO_ROOT, "docs", "*.md")))
# Shell variables the docs' commands use, as a reader would have set them.
SHELL_VARS = {"CKPT": "outputs/mine/checkpoints", "i": "0"}
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_ENTRY = re.compile(r"(?:\.venv/bin/python|python)\s+(?:-m MaxText\.(\w+)|MaxText/(\w+)\.py)\s+(.*)")
_NOT_CONFIG = {"convert_hf_checkpoint", "export_hf_checkpoint", "pretokenize"}  # flags, not a config


def _read(doc: str) -> str:
  with open(os.path.join(REPO_ROOT, doc), encoding="utf-8") as f:
    return f.read()


def _prose(text: str) -> str:
  """The text outside fenced blocks and inline code (where a link is only an example)."""
  text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
  return re.sub(r"`[^`\n]*`", "", text)


def _slug(heading: str) -> str:
  """GitHub's anchor of a heading: lower case, punctuation dropped (not - or _), spaces to hyphens."""
  text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
  return text.replace(" ", "-")


def _anchors(doc: str) -> set[str]:
  return {_slug(m) for m in re.findall(r"^#+\s+(.*)$", re.sub(r"^```.*?^```", "", _read(doc), flags=re.S | re.M),
                                       flags=re.M)}


def _fenced(text: str, lang: str) -> list[list[str]]:
  """The fenced blocks of one language, each as its lines."""
  blocks, cur = [], None
  for line in text.split("\n"):
    if line.startswith("```"):
      if cur is None and line[3:].strip() == lang:
        cur = []
      elif cur is not None:
        blocks.append(cur)
        cur = None
      continue
    if cur is not None:
      cur.append(line)
  return blocks


def _commands(block: list[str]) -> list[str]:
  """A bash block's commands: comments dropped, backslash continuations joined."""
  out, buf = [], ""
  for line in block:
    s = "" if line.lstrip().startswith("#") else re.split(r"\s+#\s", line)[0].rstrip()
    if not s:
      continue
    buf += s[:-1] + " " if s.endswith("\\") else s
    if not s.endswith("\\"):
      out.append(" ".join(buf.split()))
      buf = ""
  return out


def _doc_commands() -> list[tuple[str, str]]:
  """(doc, command) of every bash block; a variable the block assigns (`C="..."`) is substituted into the
  block's later commands (the others: SHELL_VARS, by _expand)."""
  out = []
  for doc in DOCS:
    for block in _fenced(_read(doc), "bash"):
      local = {}
      for c in _commands(block):
        c = re.sub(r"\$\{?(\w+)\}?", lambda m: local.get(m.group(1), m.group(0)), c)
        assign = re.fullmatch(r"(\w+)=(\S.*)", c)
        if assign and len(shlex.split(assign.group(2))) == 1:
          local[assign.group(1)] = shlex.split(assign.group(2))[0]
        out.append((doc, c))
  return out


def _expand(command: str) -> str:
  def var(m):
    assert m.group(1) in SHELL_VARS, f"the docs use ${m.group(1)}: add what a reader sets it to in SHELL_VARS"
    return SHELL_VARS[m.group(1)]
  return re.sub(r"\$\{?(\w+)\}?", var, command)


def test_every_relative_link_in_readme_and_docs_resolves_to_a_file_and_heading():
  broken = []
  for doc in DOCS:
    for target in _LINK.findall(_prose(_read(doc))):
      if re.match(r"[a-z]+:", target):
        continue  # http(s), mailto
      path, _, anchor = target.partition("#")
      dest = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
      if not os.path.exists(os.path.join(REPO_ROOT, dest)):
        broken.append(f"{doc}: ({target}): no file {dest}")
      elif anchor and (not dest.endswith(".md") or anchor not in _anchors(dest)):
        broken.append(f"{doc}: ({target}): no heading #{anchor} in {dest}")
  assert not broken, "\n".join(broken)


def test_link_check_catches_a_missing_file_and_a_missing_heading():
  assert _slug("A run's life") == "a-runs-life" and _slug("Train -> export -> serve") == "train---export---serve"
  assert "a-runs-life" in _anchors("docs/training.md")
  assert _LINK.findall(_prose("[x](docs/a.md#b) `[y](c.md)` ![img](d.png)")) == ["docs/a.md#b"]


_BENCH = re.compile(r"benchmarks(?:/([a-z_0-9]+\.(?:py|sh))|\.(?!md\b)([a-z_0-9]+)\b)")


def test_every_benchmark_the_docs_name_exists():
  """`benchmarks/x.py`, `benchmarks/x.sh` and `python -m benchmarks.x` in any doc, and the scripts of
  docs/benchmarks.md's table: a script removed or renamed breaks no reader's command."""
  assert _BENCH.findall("run benchmarks/decode.py, benchmarks.soak, benchmarks/NAME.py, docs/benchmarks.md") == [
      ("decode.py", ""), ("", "soak")]
  named = {(doc, f or m + ".py") for doc in DOCS for f, m in _BENCH.findall(_read(doc))}
  table = _read("docs/benchmarks.md").split("## The scripts", 1)[1].split("\n## ", 1)[0]
  named |= {("docs/benchmarks.md", f) for line in table.splitlines() if line.startswith("| `")
            for f in re.findall(r"`([a-z_0-9]+\.(?:py|sh))`", line.split("|")[1])}
  missing = sorted(f"{doc}: benchmarks/{f}" for doc, f in named if not os.path.exists(os.path.join(REPO_ROOT, "benchmarks", f)))
  assert len(named) > 20 and not missing, "\n".join(missing)


def test_readme_test_command_is_what_ci_runs():
  ci = [ln.strip() for ln in _read(".ci/run").split("\n") if "pytest tests" in ln]
  assert len(ci) == 1
  command = ci[0].split(" || ")[0]
  readme = [c for block in _fenced(_read("README.md"), "bash") for c in _commands(block)]
  assert command in readme, f"README.md's test command is not .ci/run's: {command}"


def test_every_documented_entry_point_command_is_a_valid_config():
  """Each fenced `python -m MaxText.<x> <yml> key=value ...` of the docs: its keys exist and its values
  validate (the run's own config.yml, which the docs' commands take, stands in as base.yml)."""
  from MaxText.config import pyconfig

  checked, bad = 0, []
  for doc, command in _doc_commands():
    m = _ENTRY.search(command)
    if not m or (m.group(1) or m.group(2)) in _NOT_CONFIG:
      continue
    args = shlex.split(_expand(m.group(3)).rstrip("&").strip())
    if not args or args[0].startswith("-"):
      continue  # --help: run by the next test
    yml = args[0] if args[0].startswith("configs/") else "configs/base.yml"
    overrides = [a for a in args[1:] if "=" in a]
    values = dict(a.split("=", 1) for a in overrides)
    devices = re.search(r"device_count=(\d+)", command)
    chips = values.get("compile_topology", "").split(":")[-1]  # a TPU topology's chips, e.g. v5p:8x8x4 -> 256
    num_devices = int(values.get("compile_num_devices") or (devices.group(1) if devices else 0) or
                      (math.prod(int(x) for x in chips.split("x")) if chips else 1))
    try:
      pyconfig.initialize(["doc", yml, *overrides], num_devices=num_devices)
      checked += 1
    except Exception as e:  # noqa: BLE001 - reported with the doc and command
      bad.append(f"{doc}: {command}\n    -> {e}")
  assert not bad, "\n".join(bad)
  assert checked >= 30, checked  # the extraction still finds the docs' commands


def _cheap(command: str) -> bool:
  """The documented commands cheap enough to run here: config printing, --help, the SFT data script."""
  return bool(re.search(r"-m MaxText\.config |--help$|demos/sft_conversations\.py ", command))


@pytest.mark.slow  # over 5 s of CPU (the fast lane leaves it out: README.md, Tests)
def test_cheap_documented_commands_run_as_written(tmp_path):
  commands = sorted({c for _, c in _doc_commands() if _cheap(c)})
  assert len(commands) >= 3, commands
  for command in commands:
    argv = shlex.split(command.replace("/tmp/", f"{tmp_path}/"))
    assert argv[0] == ".venv/bin/python", command
    p = subprocess.run([sys.executable, *argv[1:]], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=REPO_ROOT))
    assert p.returncode == 0, f"{command}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    if "-m MaxText.config" in command:
      assert "num_decoder_layers: 61" in p.stdout  # the 671B model's, merged over base.yml
  assert os.path.getsize(tmp_path / "sft" / "train.jsonl") > 0


def _serve_context(doc: str, marker: str) -> int:
  """max_target_length of the documented serve command in the bash block that holds `marker`."""
  for block in _fenced(_read(doc), "bash"):
    if any(marker in ln for ln in block):
      serve = [c for c in _commands(block) if "-m MaxText.serve" in c]
      assert len(serve) == 1, serve
      return int(re.search(r"max_target_length=(\d+)", serve[0]).group(1))
  raise AssertionError(f"{doc}: no bash block with {marker!r}")


def test_chat_docs_server_context_holds_one_tool_round_trip():
  """docs/chat.md's server, with the test tokenizer, takes both requests of its tool round trip: the first
  (the tools block in the system prompt) and the second (plus the tool call and its result), each with the
  max_tokens the example asks, and that max_tokens holds the call block."""
  from tokenizers import Tokenizer

  from MaxText.data import chat_dsv32

  doc = _read("docs/chat.md")
  context = _serve_context("docs/chat.md", "MaxText.serve")
  assert "tests/data/tokenizer.json" in doc
  (python,) = [b for b in _fenced(doc, "python") if any("tools=tools" in ln for ln in b)]
  code = "\n".join(python)
  scope: dict = {}
  exec(re.search(r"^tools = .*?\]$", code, re.S | re.M).group(0), scope)  # the example's tools
  exec(re.search(r"^messages = .*$", code, re.M).group(0), scope)
  max_tokens = {int(n) for n in re.findall(r"tools=tools, max_tokens=(\d+)", code)}
  assert len(max_tokens) == 1, max_tokens
  (max_tokens,) = max_tokens
  tok = Tokenizer.from_file(os.path.join(REPO_ROOT, "tests/data/tokenizer.json"))
  count = lambda text: len(tok.encode(text, add_special_tokens=False).ids)  # noqa: E731
  tools, messages = scope["tools"], scope["messages"]
  call = {"id": "call_0", "type": "function",
          "function": {"name": tools[0]["function"]["name"], "arguments": json.dumps({"city": "Paris"})}}
  second = messages + [{"role": "assistant", "content": "", "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "call_0", "content": json.dumps({"sky": "sunny", "city": "Paris"})}]
  for thinking in (False, True):
    first_prompt = count(chat_dsv32.render(messages, thinking=thinking, tools=tools))
    second_prompt = count(chat_dsv32.render(second, thinking=thinking, tools=tools))
    assert first_prompt + max_tokens <= context and second_prompt + max_tokens <= context, (
        f"docs/chat.md: max_target_length={context} cannot hold {first_prompt} / {second_prompt} prompt tokens "
        f"+ max_tokens={max_tokens}")
  assert count(chat_dsv32.render_tool_calls([call])) + 1 <= max_tokens  # the call block and its EOS


def test_lm_eval_doc_waits_for_health_and_passes_the_servers_context_minus_one():
  for block in _fenced(_read("docs/scoring.md"), "bash"):
    commands = _commands(block)
    lm_eval = [i for i, c in enumerate(commands) if "lm_eval --model" in c]
    if not lm_eval or not any("-m MaxText.serve" in c for c in commands):
      continue
    context = _serve_context("docs/scoring.md", "lm_eval --model")
    text = "\n".join(commands)
    assert 0 <= text.find("/health") < text.find("lm_eval --model"), "lm_eval starts before the server answers /health"
    for i in lm_eval:
      assert f"max_length={context - 1}," in commands[i] + ",", commands[i]
    return
  raise AssertionError("docs/scoring.md: no bash block that serves and runs lm_eval")


def test_rl_doc_lists_exactly_the_console_metrics_rl_prints():
  from MaxText import rl

  (line,) = re.findall(r"`step n/steps \|(.*?)`", _read("docs/rl.md"), re.S)
  documented = tuple(part.split()[0] for part in line.split("|") if part.strip())
  assert documented == rl.CONSOLE


@pytest.mark.slow  # three entry points end to end (~2-4 min of CPU)
def test_the_lora_docs_tiny_path_runs_as_written(tmp_path):
  """docs/lora.md's first block, the tiny model's path, run as written but for fewer steps (10 and 5), the outputs
  under tmp_path and another port: a base, the SFT data, a LoRA SFT over the base, the base served with the adapter
  by name, and the documented curl answered by that adapter (OpenAI's body, "model": "adder")."""
  import signal

  import httpx

  from tests.support.server_harness import wait_for
  from tests.support.train_processes import free_port

  (block,) = [b for b in _fenced(_read("docs/lora.md"), "bash") if any("serve_lora_adapters=[adder=" in ln for ln in b)]
  commands = _commands(block)
  assert [c.split()[1] for c in commands] == ["MaxText/train.py", "demos/sft_conversations.py", "-m", "-m", "localhost:8000/v1/chat/completions"]
  port = free_port()
  env = dict(os.environ, PYTHONPATH=REPO_ROOT)

  def argv(command: str) -> list[str]:
    command = command.replace("/tmp/sft", f"{tmp_path}/sft").replace("outputs/", f"{tmp_path}/outputs/")
    command = command.replace("8000", str(port)).replace("steps=100", "steps=5")
    args = shlex.split(command)
    if "MaxText/train.py" in command or "-m MaxText.train" in command:
      args += [f"base_output_directory={tmp_path}/outputs", "steps=10" if "tiny_base" in command else "steps=5"]
    return [sys.executable, *args[1:]] if args[0] == ".venv/bin/python" else args

  for command in commands[:3]:
    p = subprocess.run(argv(command), cwd=REPO_ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert p.returncode == 0, f"{command}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
  assert "dropped" in p.stdout + p.stderr  # the LoRA SFT says that the tool conversations do not fit
  server = subprocess.Popen(argv(commands[3]), cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
  def healthy() -> bool:
    assert server.poll() is None, server.stdout.read()[-3000:]  # ended before it was ready
    try:
      return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
      return False

  try:
    wait_for(healthy, "the LoRA server's /health", timeout=600, poll=1)
    curl = shlex.split(commands[4].replace("8000", str(port)))
    body = json.loads(curl[curl.index("-d") + 1])
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["model"] == "adder", r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"
    models = [m["id"] for m in httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"]]
    assert models == ["deepseek3.2-tiny", "adder"], models
  finally:
    server.send_signal(signal.SIGTERM)
    out = server.communicate(timeout=120)[0]
  assert "LoRA adapters adder (rank 8, alpha 16) on" in out, out[-3000:]
