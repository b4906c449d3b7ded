"""Long-context decode: python MaxText/decode.py configs/base.yml [key=value ...]

    python MaxText/decode.py configs/base.yml load_parameters_path=outputs/default/checkpoints \
        tokenizer_path=tests/data/tokenizer.model prompt="I love to|The sea" max_target_length=256
    python MaxText/decode.py configs/base.yml prompt="1,17,42|1,99" decode_sampling_strategy=top_p

prompt: text when tokenizer_path is set (tokenizer_type picks sentencepiece or hf; BOS prepended
  when add_bos), else comma-separated token ids taken as given. Several prompts form one batch:
  separate them with '|' (ragged lengths are fine: each row keeps its own length). Each prompt is
  one request to the continuous-batching engine (inference/serving.py, paged caches: serve_* keys).
Each row stops at EOS (the tokenizer's, else eos_id), or when prompt + generated tokens reach
max_target_length (the cache size; a note says so). A prompt may have up to max_prefill_length
tokens; prefill runs in chunks of prefill_chunk_size (0 = one shot), then one jitted step per token.
Sampling: decode_sampling_strategy greedy | temperature | top_p (decode_sampling_temperature,
decode_sampling_nucleus_p), row i seeded by `seed` + i. The cache dtype is kv_cache_dtype.
load_parameters_path: a converter output, a training run's checkpoints folder (its newest usable
step), one step folder (checkpoints/<step>) or its state subfolder; the model keys must be the run's
(its config.yml, or the converter's model.yml, can be the config file). Without it the model is
randomly initialized (said on the first line): a smoke test.

A single prompt is streamed as it is generated; a batch prints each row when all are done. Then
one summary line per row: `row <i>: stop=<eos|max_target_length> prompt_tokens=<n> generated_tokens=<m>`
and `row <i> ids: <comma-separated ids>`.
Bad input (an unknown key, a prompt over max_prefill_length, a missing checkpoint, ...) prints
one `error:` line naming the key and value and exits non-zero (2 for input, 1 for the checkpoint).
"""

from __future__ import annotations

import sys

if not __package__ and __name__ == "__main__":  # run as `python MaxText/decode.py`: import the package, not from MaxText/
  import _script_path  # noqa: F401

import dataclasses
import re
import time
from typing import Sequence

from MaxText.config.types import Config, ConfigError
from MaxText.runtime import cli, distributed

PROMPT_SEPARATOR = "|"
_IDS = re.compile(r"^\s*\d+(\s*,\s*\d+)*\s*,?\s*$")


class PromptError(ConfigError):
  """A prompt decode cannot take: the message names the key (prompt, max_prefill_length, ...)."""


@dataclasses.dataclass
class Generation:
  """One row's result."""
  prompt: list[int]
  tokens: list[int]    # generated ids, EOS excluded
  stop: str            # "eos" | "max_target_length"


def check_prompts(config: Config, prompts: Sequence[Sequence[int]]) -> None:
  """Raises PromptError for a prompt decode cannot take (empty, too long, ids out of range)."""
  cfg = config
  if not prompts:
    raise PromptError("prompt is empty: give at least one prompt")
  for i, p in enumerate(prompts):
    where = f"prompt row {i}" if len(prompts) > 1 else "prompt"
    if len(p) == 0:
      raise PromptError(f"{where} has no tokens (prompt={cfg.prompt!r})")
    if len(p) > cfg.max_prefill_length:
      raise PromptError(f"{where} has {len(p)} tokens, more than max_prefill_length={cfg.max_prefill_length}; "
                        f"raise max_prefill_length (<= max_target_length={cfg.max_target_length}) or shorten it")
    if len(p) >= cfg.max_target_length:
      raise PromptError(f"{where} has {len(p)} tokens, which fills max_target_length={cfg.max_target_length} "
                        f"(prompt + generated tokens must fit in it): raise max_target_length")
    bad = [int(x) for x in p if not 0 <= int(x) < cfg.vocab_size]
    if bad:
      raise PromptError(f"{where} has token ids {bad[:5]} outside [0, vocab_size={cfg.vocab_size})")


def parse_prompts(config: Config, tokenizer) -> list[list[int]]:
  """The `prompt` key -> token ids per row ('|' separates rows)."""
  parts = config.prompt.split(PROMPT_SEPARATOR)
  if tokenizer is None:
    rows = []
    for i, part in enumerate(parts):
      if not _IDS.match(part):
        raise ConfigError(f"prompt={config.prompt!r}: part {i} ({part!r}) is not comma-separated token ids; "
                          "set tokenizer_path=<tokenizer.model or tokenizer.json> to give text")
      rows.append([int(x) for x in part.replace(" ", "").strip(",").split(",")])
    return rows
  bos = [tokenizer.bos_id] if config.add_bos else []
  return [bos + tokenizer.encode(part) for part in parts]


def sampling(config: Config, row: int, prompt_length: int):
  """Row `row`'s request options from the decode_sampling_* keys: generate until EOS or the cache
  (max_target_length) is full; seeded by `seed` + row."""
  from MaxText.inference.scheduler import SamplingParams
  strategy = config.decode_sampling_strategy
  return SamplingParams(max_tokens=config.max_target_length - prompt_length,
                        temperature=0.0 if strategy == "greedy" else config.decode_sampling_temperature,
                        top_p=config.decode_sampling_nucleus_p if strategy == "top_p" else 1.0,
                        seed=config.seed + row)


def run(config: Config, out=sys.stdout, err=sys.stderr) -> list:
  import jax

  from MaxText.checkpoint import model_state
  from MaxText.data.tokenizer import TextStreamer, load_tokenizer
  from MaxText.inference import kv_cache
  from MaxText.inference.serving import ServingEngine
  from MaxText.runtime import sharding

  tokenizer = load_tokenizer(config) if config.tokenizer_path else None
  prompts = parse_prompts(config, tokenizer)
  eos_id = tokenizer.eos_id if tokenizer is not None else config.eos_id
  check_prompts(config, prompts)  # before any compile: bad prompts fail fast

  mesh = sharding.create_mesh(config)
  with jax.set_mesh(mesh), sharding.logical_rules(config, mesh):
    graphdef, params, buffers, source = model_state.load_or_create(
        config, mesh, report=lambda line: print(line, file=sys.stderr, flush=True))
    vocab = tokenizer.vocab_size if tokenizer is not None and tokenizer.vocab_size < config.vocab_size else None
    engine = ServingEngine(config, graphdef, params, buffers, sample_vocab=vocab, eos_id=eos_id)
    print(f"decode: model {config.model_name} ({model_state.count_params(params):,} parameters), {source}",
          file=out, flush=True)
    print(f"decode: {kv_cache.describe(config)}; attention {engine.mode}"
          + (f" (top-{config.indexer_topk}{', approx' if config.indexer_use_approx_top_k else ''})"
             if engine.mode == "sparse" else "")
          + f"; {len(prompts)} prompt(s) of {[len(p) for p in prompts]} tokens; "
            f"sampling {config.decode_sampling_strategy}", file=err, flush=True)

    stream = len(prompts) == 1
    streamers = [TextStreamer(tokenizer, p) for p in prompts] if tokenizer is not None else None
    texts = [""] * len(prompts)

    def on_token(row: int, tok: int) -> None:
      piece = streamers[row].push(tok) if streamers is not None else ("," if texts[row] else "") + str(tok)
      texts[row] += piece
      if stream:
        print(piece, end="", file=out, flush=True)

    if stream:
      shown = tokenizer.decode(prompts[0]) if tokenizer is not None else ",".join(map(str, prompts[0])) + " ->"
      print(shown, end="" if tokenizer is not None else " ", file=out, flush=True)
    t0 = time.perf_counter()
    results = [Generation(r.prompt, r.output, "eos" if r.finish_reason == "stop" else "max_target_length")
               for r in engine.generate(prompts, [sampling(config, i, len(p)) for i, p in enumerate(prompts)],
                                        on_token=on_token)]
    dt = time.perf_counter() - t0
    if stream:
      print(file=out, flush=True)
    else:
      for i, r in enumerate(results):
        prompt_text = tokenizer.decode(r.prompt) if tokenizer is not None else ",".join(map(str, r.prompt))
        print(f"[{i}] {prompt_text} -> {texts[i]}", file=out)
    for i, r in enumerate(results):
      print(f"row {i}: stop={r.stop} prompt_tokens={len(r.prompt)} generated_tokens={len(r.tokens)}", file=out)
      print(f"row {i} ids: {','.join(map(str, r.tokens))}", file=out)
      if r.stop == "max_target_length":
        print(f"note: row {i} stopped at max_target_length={config.max_target_length} "
              f"({len(r.prompt)} prompt + {len(r.tokens)} generated tokens fill the cache); "
              "raise max_target_length to generate more", file=err)
    n = sum(len(r.tokens) for r in results)
    print(f"decode: {n} tokens in {dt:.2f} s (incl. compile)", file=err, flush=True)
    return results


def main(argv) -> None:
  cli.entry_point(argv, __doc__, run)  # bad prompts, tokenizer files: exit 2; checkpoints: exit 1


if __name__ == "__main__":
  distributed.run_main(main, sys.argv)
