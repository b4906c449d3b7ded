"""lm-evaluation-harness against our server, and the same items scored by our own training model
(tests/integration/test_server.py; lm-eval is a test requirement, imported only by run_lm_eval).

`run_lm_eval` runs lm-eval's `local-completions` model in this process (`simple_evaluate`: no second
interpreter) on local tasks (TASKS_DIR: the repository's tests/data/lm_eval) (tiny_mc: multiple choice by loglikelihood;
tiny_gen: greedy generate_until), tokenizing through the server's /tokenize (tokenizer_backend=remote),
with lm-eval's per-item samples. `Teacher` scores the same items with the training model's teacher-forced
log-softmax, tokenized as lm-eval does: a choice's continuation = the ids of context + " " + choice past
the context's ids (its `_encode_pair`; " " its target_delimiter), no BOS (the remote tokenizer encodes with
add_special_tokens=False); its greedy continuation takes the argmax below the tokenizer's vocabulary (the
server never samples past it) until EOS or max_gen_toks, cut at the task's "\\n" as lm-eval cuts it.
`loopback_only` records (and refuses) every connection or name lookup past 127.0.0.1 while lm-eval runs.
"""

from __future__ import annotations

import contextlib
import os
import socket

import jax
import numpy as np

from MaxText.checkpoint import model_state

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a source checkout's
TASKS_DIR = os.path.join(REPO_ROOT, "tests", "data", "lm_eval")
LOOPBACK = ("127.0.0.1", "::1", "localhost")
MAX_GEN_TOKS = 4  # tiny_gen.yaml's generation_kwargs


@contextlib.contextmanager
def loopback_only():
  """-> the list of addresses anything in this process tried to reach past the loopback (each refused
  with an OSError) while the block runs: connect / connect_ex and name lookups (asyncio's too)."""
  tried = []
  connect, connect_ex, getaddrinfo = socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo

  def guard(address):
    if isinstance(address, tuple) and address[0] not in LOOPBACK:
      tried.append(address)
      raise OSError(f"lm_eval_client: the network is off ({address})")

  def lookup(host, *args, **kwargs):
    if host not in LOOPBACK and host is not None:
      tried.append(host)
      raise socket.gaierror(f"lm_eval_client: the network is off ({host})")
    return getaddrinfo(host, *args, **kwargs)

  socket.socket.connect = lambda self, address: (guard(address), connect(self, address))[1]
  socket.socket.connect_ex = lambda self, address: (guard(address), connect_ex(self, address))[1]
  socket.getaddrinfo = lookup
  try:
    yield tried
  finally:
    socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo = connect, connect_ex, getaddrinfo


def run_lm_eval(url: str, model: str) -> dict[str, list[dict]]:
  """lm-eval's local-completions against the server at `url` on tiny_mc and tiny_gen -> each task's
  samples (lm-eval's per-item records) by doc_id. Nothing downloaded: HF_*_OFFLINE set, the data local."""
  os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
  import datasets.config  # read its environment when first imported (maybe before this): offline now, no
  datasets.config.HF_HUB_OFFLINE = True  # download-count HEAD to s3.amazonaws.com per load_dataset("json")
  datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
  import lm_eval
  from lm_eval.tasks import TaskManager
  args = dict(base_url=f"{url}/v1/completions", model=model, tokenizer_backend="remote", tokenized_requests=True,
              num_concurrent=1, max_retries=1)
  cwd = os.getcwd()
  os.chdir(REPO_ROOT)  # the YAMLs' data_files are relative to the repository root
  try:
    out = lm_eval.simple_evaluate("local-completions", model_args=args, tasks=["tiny_mc", "tiny_gen"],
                                  task_manager=TaskManager(include_path=TASKS_DIR), log_samples=True,
                                  bootstrap_iters=0)
  finally:
    os.chdir(cwd)
  return {task: sorted(samples, key=lambda s: s["doc_id"]) for task, samples in out["samples"].items()}


class Teacher:
  """The training model's teacher-forced log-softmax over one [1, length] program (sequences padded at
  the end: causal, so padding changes no earlier position), with the server's tokenizer."""

  def __init__(self, graphdef, params, buffers, tokenizer, length: int):
    self.tok, self.length = tokenizer, length
    fwd = jax.jit(lambda p, b, t: jax.nn.log_softmax(model_state.merge(graphdef, p, b)(t)[0][0], axis=-1))  # [T,V]
    self._lsm = lambda seq: np.asarray(fwd(params, buffers, np.asarray([seq + [0] * (length - len(seq))], np.int32)))

  def loglikelihood(self, context: str, continuation: str) -> float:
    """log p(continuation | context) as lm-eval tokenizes the pair (no BOS)."""
    ctx, whole = self.tok.encode(context), self.tok.encode(context + continuation)  # [T,V] row p-1 predicts p
    lsm = self._lsm(whole)
    return float(sum(lsm[i - 1, whole[i]] for i in range(len(ctx), len(whole))))

  def choices(self, doc: dict) -> list[float]:
    """Each choice's loglikelihood after the question (lm-eval's target_delimiter " ")."""
    return [self.loglikelihood(doc["question"], " " + c) for c in doc["choices"]]

  def greedy(self, context: str, max_tokens: int = MAX_GEN_TOKS, until: str = "\n") -> str:
    """The argmax continuation below the tokenizer's vocabulary, stopped at EOS, cut at `until`."""
    seq, made = self.tok.encode(context), []
    for _ in range(max_tokens):
      nxt = int(np.argmax(self._lsm(seq)[len(seq) - 1, :self.tok.vocab_size]))
      if nxt == self.tok.eos_id:
        break
      seq, made = seq + [nxt], made + [nxt]
    return self.tok.decode(made).split(until)[0]


__all__ = ["loopback_only", "run_lm_eval", "Teacher", "TASKS_DIR"]
