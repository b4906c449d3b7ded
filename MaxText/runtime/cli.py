"""What an entry point does with errors: one line and a non-zero exit for every input or
environment problem, a traceback only for a real bug.

    cli.run(lambda: train(config))
    cli.entry_point(argv, __doc__, train)   # an entry point's main(argv): config, processes, then run

Exit 2: the config or an input it names (ConfigError: keys, data files, tokenizer).
Exit 1: a run that cannot go on (RunError: checkpoints, the run folder, training), the file system
(permissions, a full disk), and `also`.
MAXTEXT_TRACEBACK=1 re-raises every error with its traceback (for debugging).
"""

from __future__ import annotations

import os
import sys
from typing import Callable

from MaxText.config.types import ConfigError

TRACEBACK_ENV = "MAXTEXT_TRACEBACK"


class RunError(RuntimeError):
  """A run cannot go on, through no bug of ours (a checkpoint, the run folder, a non-finite loss):
  one line and exit 1. Each concern subclasses it (CheckpointError, RunFolderError, TrainingError)."""


class FieldError(ValueError):
  """Bad input in a named field of what a caller sent (a request, a message, a grammar): `field` names it
  (e.g. messages[3].tool_call_id); the server answers HTTP 400 with it as OpenAI's `param`. Each concern
  subclasses it (scheduler.RequestError, grammar.GrammarError, chat_dsv32.ChatFormatError)."""

  def __init__(self, message: str, field: str):
    super().__init__(message)
    self.field = field


def _describe(e: BaseException) -> str:
  if isinstance(e, OSError) and e.strerror:
    where = f": {e.filename}" if e.filename else ""
    return f"{e.strerror}{where} (check that the folder is writable and the disk has free space)"
  return str(e)


def quiet_libraries() -> None:
  """orbax/absl warn on the console about their own internals (missing optional metadata files, ...);
  tensorboardX about a non-finite scalar, which the training loop's own guard reports in one line."""
  import logging
  logging.getLogger("absl").setLevel(logging.ERROR)
  logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)


def run(fn: Callable[[], object], also: tuple[type[BaseException], ...] = ()) -> None:
  exit2 = (ConfigError,)
  exit1 = (RunError, OSError) + tuple(also)
  try:
    fn()
  except exit2 + exit1 as e:
    if os.environ.get(TRACEBACK_ENV):
      raise
    sys.stdout.flush()
    print(f"error: {_describe(e)}", file=sys.stderr, flush=True)
    sys.exit(2 if isinstance(e, exit2) else 1)
  except KeyboardInterrupt:
    print("interrupted", file=sys.stderr, flush=True)
    sys.exit(130)


def entry_point(argv, doc: str, work: Callable[[object], object]) -> None:
  """An entry point's main(argv) (train, decode, serve, rl): the Config from argv (a bad one, or --help:
  doc's usage, pyconfig.initialize_or_exit), the processes joined (jax.distributed, as the config asks),
  library chatter quieted, the persistent compile cache on; then work(config) under `run`."""
  from MaxText.config import pyconfig
  from MaxText.runtime import compile_cache, distributed
  config = pyconfig.initialize_or_exit(argv, doc, num_devices=distributed.initialize)  # joins the processes
  quiet_libraries()
  compile_cache.enable(config)
  run(lambda: work(config))
