"""The README's own commands as a user runs them, each a section of the device check (device_check.py):

  readme_train   `python MaxText/train.py configs/base.yml indexer_use_approx_top_k=true` (the first command):
                 the LM loss falls, the process exits 0 and within EXIT_S of its closing `done:` line
  readme_decode  `python MaxText/decode.py <run>/config.yml load_parameters_path=<run>/checkpoints prompt="1,2,3,4"
                 max_prefill_length=16` on that run's weights: exit 0, a continuation, exit within EXIT_S
  readme_serve   the README's chat server (`python -m MaxText.serve configs/base.yml tokenizer_type=hf
                 tokenizer_path=tests/data/tokenizer.json max_target_length=2048`) on a unix socket (serve_uds: a
                 host may allow no TCP socket, as the lent TPU does): seconds to /health 200, a completion and a
                 chat answered, exit 0 within EXIT_S of SIGTERM
  readme_lora    the SFT demo's conversations, a LoRA SFT (the README's SFT command with lora_rank) over the
                 readme_train run's weights, the adapter served by name (serve_lora_adapters) and asked by it
  v5e_train      configs/models/deepseek3.2-v5e.yml (1.16B parameters) trained by train.py with its own defaults
                 (an accelerator only): the LM loss falls over its steps, nothing non-finite

Each returns a dict of figures with `ok` (bool) and `why` (what failed) for device_check's table. Commands run in
the checkout with their outputs under one work folder (base_output_directory), each bounded in time.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXIT_S = 10.0  # a process ends within this many seconds of its last line (train, decode) or of SIGTERM (serve)
TOKENIZER = "tests/data/tokenizer.json"
CHAT_SERVER = ["configs/base.yml", "tokenizer_type=hf", f"tokenizer_path={TOKENIZER}", "max_target_length=2048"]
STEP = re.compile(r"^step (\d+)/\d+ \| loss (\S+) \| lm (\S+)")

SIZES = {  # steps of each training command: the README's on an accelerator, fewer on the CPU
    "cpu": dict(train_steps=30, lora_steps=15, v5e_steps=0),
    "accelerator": dict(train_steps=150, lora_steps=40, v5e_steps=200),
}


def _python(*args: str) -> list[str]:
  return [sys.executable, *args]


def run_timed(cmd: list[str], log: str, limit: float, env: dict | None = None) -> dict:
  """Runs cmd in the checkout, its output line by line into `log` with the second each line came:
  -> rc (None: killed at `limit` s), seconds, lines [(s, text)], and the seconds from the last line to the exit."""
  t0 = time.perf_counter()
  lines: list[tuple[float, str]] = []
  with open(log, "w") as f:
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env,
                         start_new_session=True)
    killed = threading.Event()

    def kill():
      killed.set()
      os.killpg(p.pid, signal.SIGKILL)
    timer = threading.Timer(limit, kill)
    timer.start()
    for line in p.stdout:
      lines.append((time.perf_counter() - t0, line.rstrip("\n")))
      f.write(line)
      f.flush()
    rc = p.wait()
    timer.cancel()
  end = time.perf_counter() - t0
  return dict(rc=None if killed.is_set() else rc, seconds=round(end, 1), lines=lines,
              exit_after_last_s=round(end - lines[-1][0], 1) if lines else None)


def _line_at(run: dict, prefix: str) -> float | None:
  """The second the first line starting with prefix came, or None."""
  return next((t for t, text in run["lines"] if text.startswith(prefix)), None)


def _losses(run: dict) -> list[tuple[int, float]]:
  out = []
  for _, text in run["lines"]:
    m = STEP.match(text)
    if m:
      out.append((int(m.group(1)), float(m.group(3))))
  return out


def _tail(run: dict, n: int = 2) -> str:
  return " | ".join(text for _, text in run["lines"][-n:])[-300:]


def _mean(values: list[float]) -> float:
  return round(sum(values) / len(values), 4)


def _train_figures(run: dict, what: str) -> dict:
  """A train.py run's figures: the mean LM loss of the first and of the last quarter of its logged steps (one
  step each with fewer than 8 logged: a batch's loss varies, the v5e file's 0.9-14.5 a step at one sequence a
  batch), seconds to `done:`, seconds from it to the exit."""
  losses, done = _losses(run), _line_at(run, "done:")
  q = max(1, len(losses) // 4)
  out = dict(command=what, rc=run["rc"], seconds=run["seconds"], steps=losses[-1][0] if losses else 0,
             first_lm=_mean([v for _, v in losses[:q]]) if losses else None,
             last_lm=_mean([v for _, v in losses[-q:]]) if losses else None,
             done_s=None if done is None else round(done, 1),
             exit_after_done_s=None if done is None else round(run["seconds"] - done, 1))
  why = ("exit " + str(run["rc"]) + ": " + _tail(run) if run["rc"] != 0 else
         "no done: line" if done is None else
         f"the loss did not fall ({out['first_lm']} -> {out['last_lm']})" if len(losses) < 2 or
         not out["last_lm"] < out["first_lm"] else
         f"exited {out['exit_after_done_s']} s after its done: line (> {EXIT_S:g})"
         if out["exit_after_done_s"] > EXIT_S else "")
  return dict(out, ok=not why, why=why)


def readme_train(size: str, work: str) -> dict:
  steps = SIZES[size]["train_steps"]
  cmd = _python("MaxText/train.py", "configs/base.yml", "indexer_use_approx_top_k=true", "run_name=readme",
                f"base_output_directory={work}", f"steps={steps}")
  run = run_timed(cmd, os.path.join(work, "readme_train.log"), 600)
  return _train_figures(run, " ".join(cmd[1:4]) + f" steps={steps}")


def readme_decode(size: str, work: str) -> dict:
  runs = os.path.join(work, "readme")
  cmd = _python("MaxText/decode.py", f"{runs}/config.yml", f"load_parameters_path={runs}/checkpoints",
                "prompt=1,2,3,4", "max_prefill_length=16")
  run = run_timed(cmd, os.path.join(work, "readme_decode.log"), 300)
  why = ("exit " + str(run["rc"]) + ": " + _tail(run) if run["rc"] != 0 else
         f"exited {run['exit_after_last_s']} s after its last line" if run["exit_after_last_s"] > EXIT_S else "")
  return dict(command="MaxText/decode.py <readme run>/config.yml ... prompt=1,2,3,4", rc=run["rc"],
              seconds=run["seconds"], exit_after_last_s=run["exit_after_last_s"], output=_tail(run, 1), ok=not why,
              why=why)


def _serve(args: list[str], work: str, name: str, requests, limit: float = 420) -> dict:
  """Starts `python -m MaxText.serve *args` on a unix socket, waits for /health 200, sends requests(client) ->
  (status, body) pairs, then SIGTERM: seconds to ready, the answers, seconds from SIGTERM to the exit. The log
  (work/name.log) has each line's second from the start, jax's compiles among them (JAX_LOG_COMPILES)."""
  import httpx
  sock = os.path.join(work, f"{name}.sock")
  log = open(os.path.join(work, f"{name}.log"), "w")
  t0 = time.perf_counter()
  p = subprocess.Popen(_python("-m", "MaxText.serve", *args, f"serve_uds={sock}"), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True, text=True,
                       env=dict(os.environ, JAX_LOG_COMPILES="1"))  # each compile a line: where the start goes

  def copy():  # each line into the log with the second it came (from the start)
    for line in p.stdout:
      log.write(f"[{time.perf_counter() - t0:7.1f} s] {line}")
      log.flush()
  reader = threading.Thread(target=copy, daemon=True)
  reader.start()
  client = httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://localhost", timeout=120)
  out = dict(ready_s=None, answers=[], exit_after_sigterm_s=None, rc=None)
  try:
    while time.perf_counter() - t0 < limit and p.poll() is None:
      try:
        if client.get("/health").status_code == 200:
          out["ready_s"] = round(time.perf_counter() - t0, 1)
          break
      except httpx.TransportError:
        pass
      time.sleep(0.2)
    if out["ready_s"] is not None:
      for path, body in requests:
        t1 = time.perf_counter()
        r = client.post(path, json=body)
        out["answers"].append(dict(path=path, status=r.status_code, seconds=round(time.perf_counter() - t1, 2),
                                   body=r.json() if r.headers.get("content-type", "").startswith("application/json")
                                   else r.text[:200]))
    t1 = time.perf_counter()
    p.send_signal(signal.SIGTERM)
    try:
      out["rc"] = p.wait(60)
      out["exit_after_sigterm_s"] = round(time.perf_counter() - t1, 1)
    except subprocess.TimeoutExpired:
      pass
  finally:
    client.close()
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGKILL)
      p.wait()
    reader.join(10)
    log.close()
  with open(os.path.join(work, f"{name}.log")) as f:
    out["log_tail"] = " | ".join(f.read().strip().splitlines()[-2:])[-300:]
  return out


def _serve_verdict(out: dict) -> str:
  bad = [a for a in out["answers"] if a["status"] != 200]
  return ("no /health 200: " + out["log_tail"] if out["ready_s"] is None else
          f"{bad[0]['path']} answered {bad[0]['status']}: {json.dumps(bad[0]['body'])[:200]}" if bad else
          f"alive {out['exit_after_sigterm_s'] or 60} s after SIGTERM" if out["rc"] is None or
          out["exit_after_sigterm_s"] > EXIT_S else f"exit {out['rc']} after SIGTERM" if out["rc"] != 0 else "")


def _text(answer: dict) -> str:
  choice = answer["body"]["choices"][0]
  return choice.get("text", (choice.get("message") or {}).get("content", ""))


def readme_serve(size: str, work: str) -> dict:
  out = _serve(CHAT_SERVER, work, "readme_serve", [
      ("/v1/completions", {"prompt": "I love to", "max_tokens": 16, "temperature": 0}),
      ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16})])
  why = _serve_verdict(out)
  return dict(command="python -m MaxText.serve " + " ".join(CHAT_SERVER) + " serve_uds=...", ready_s=out["ready_s"],
              answers=[dict(path=a["path"], status=a["status"], seconds=a["seconds"]) for a in out["answers"]],
              exit_after_sigterm_s=out["exit_after_sigterm_s"], ok=not why, why=why)


def readme_lora(size: str, work: str) -> dict:
  steps, sft = SIZES[size]["lora_steps"], os.path.join(work, "sft")
  data = run_timed(_python("demos/sft_conversations.py", "--out", sft), os.path.join(work, "readme_lora_data.log"), 120)
  if data["rc"] != 0:
    return dict(ok=False, why="demos/sft_conversations.py: " + _tail(data))
  base = os.path.join(work, "readme", "checkpoints")
  cmd = _python("-m", "MaxText.train", "configs/base.yml", "run_name=lora", f"base_output_directory={work}",
                "use_sft=true", "train_data_columns=[messages]", "dataset_type=file",
                f"dataset_path={sft}/train.jsonl", "tokenizer_type=hf", f"tokenizer_path={TOKENIZER}",
                f"steps={steps}", "lora_rank=8", "lora_alpha=16", f"load_parameters_path={base}", "log_period=5")
  train = _train_figures(run_timed(cmd, os.path.join(work, "readme_lora_train.log"), 600), "LoRA SFT")
  out = dict(command="python -m MaxText.train configs/base.yml use_sft=true ... lora_rank=8 lora_alpha=16 "
             f"load_parameters_path=<readme run> steps={steps}", train=train)
  if not train["ok"]:
    return dict(out, ok=False, why="LoRA SFT: " + train["why"])
  served = _serve(CHAT_SERVER + [f"load_parameters_path={base}", f"serve_lora_adapters=[mine={work}/lora]"], work,
                  "readme_lora_serve", [("/v1/chat/completions", {"model": "mine", "max_tokens": 8, "temperature": 0,
                                                                  "messages": [{"role": "user", "content": "Hi"}]})])
  why = _serve_verdict(served)
  answer = served["answers"][0] if served["answers"] else None
  if not why and answer["body"].get("model") != "mine":
    why = f"asked for model mine, answered by {answer['body'].get('model')!r}"
  return dict(out, ready_s=served["ready_s"], answer_s=answer and answer["seconds"],
              exit_after_sigterm_s=served["exit_after_sigterm_s"], ok=not why, why=why and "serving: " + why)


def v5e_train(size: str, work: str) -> dict:
  steps = SIZES[size]["v5e_steps"]
  if not steps:
    return dict(ok=True, why="", note="an accelerator's section (1.16B parameters)")
  cmd = _python("MaxText/train.py", "configs/base.yml", "model_name=deepseek3.2-v5e", "run_name=v5e",
                f"base_output_directory={work}", f"steps={steps}", "enable_checkpointing=false", "log_period=5")
  return _train_figures(run_timed(cmd, os.path.join(work, "v5e_train.log"), 600),
                        f"MaxText/train.py configs/base.yml model_name=deepseek3.2-v5e steps={steps}")


SECTIONS = {"readme_train": readme_train, "readme_decode": readme_decode, "readme_serve": readme_serve,
            "readme_lora": readme_lora, "v5e_train": v5e_train}


def fmt(name: str, r: dict) -> str:
  """One table row's figures."""
  if name in ("readme_train", "v5e_train") or (name == "readme_lora" and "train" in r and "ready_s" not in r):
    t = r.get("train", r)
    if "steps" not in t:
      return r.get("note") or r.get("why", "")
    return (f"{t['steps']} steps, lm {t['first_lm']} -> {t['last_lm']} (first -> last quarter), done at {t['done_s']} s, exit "
            f"{t['exit_after_done_s']} s after it" + (f"; {r['why']}" if r.get("why") else ""))
  if name == "readme_decode":
    return f"{r.get('seconds')} s, exit {r.get('exit_after_last_s')} s after its last line" + \
        (f"; {r['why']}" if r.get("why") else "")
  if name in ("readme_serve", "readme_lora"):
    head = ""
    if name == "readme_lora":
      t = r["train"]
      head = f"SFT {t['steps']} steps lm {t['first_lm']} -> {t['last_lm']}; served by name: "
    answers = ", ".join(f"{'chat' if 'chat' in a['path'] else 'completion'} {a['status']} in {a['seconds']} s"
                        for a in r.get("answers", []))
    if name == "readme_lora" and r.get("answer_s") is not None:
      answers = f"chat 200 in {r['answer_s']} s"
    return (head + f"/health 200 at {r.get('ready_s')} s; {answers}; exit {r.get('exit_after_sigterm_s')} s after "
            "SIGTERM" + (f"; {r['why']}" if r.get("why") else ""))
  return r.get("why", "")
