"""Serving: continuous batching (inference/serving.py) vs a static batch of the old kind.

    python benchmarks/serving.py            # the tiny model and a mid-size one (8 layers, emb 512, 8K contexts)
    python benchmarks/serving.py --quick    # the tiny model, fewer requests, a shorter system prompt

One seeded workload (Poisson arrivals, uniform prompt and log-uniform output lengths, greedy) through one
ServingEngine per policy, in real time. Prints output tokens/s, TTFT and TPOT (p50, p99) per policy; then
`prefix` (the prefix cache's TTFT), `speculative` (MTP drafts' acceptance and speedup) and
`structured` (--structured-only: free rows beside constrained ones); then one JSON line. Never a timed assert.
"""
from __future__ import annotations

import argparse
import gc
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from MaxText import train
from MaxText.checkpoint import model_state
from MaxText.config import pyconfig
from MaxText.data.input_pipeline import SyntheticBatches, create_data_iterator
from MaxText.data.tokenizer import load_tokenizer
from MaxText.inference.grammar import Grammars, GrammarSpec
from MaxText.inference.scheduler import SamplingParams
from MaxText.inference.serving import ServingEngine
from MaxText.runtime import sharding

MID = dict(num_decoder_layers=8, first_num_dense_layers=1, emb_dim=512, mlp_dim=1024, num_query_heads=8,
           moe_mlp_dim=256, num_experts=8, num_experts_per_tok=2)
POLICIES = ("continuous", "static", "static-shrink")
# the tiny model's workload (rate: arrivals a second, 100: about 16 in flight; seqs: concurrent sequences, a static
# batch's rows; tokens: serve_max_num_tokens; chunk: prefill_chunk_size); prefix(), speculative(), structured()'s
WORKLOAD = dict(requests=128, rate=100.0, seqs=16, tokens=512, chunk=64, page=16, prompt_min=8, prompt_max=96,
                out_min=4, out_max=256, max_len=384, system=1024, prefix_requests=8, prefix_gap=0.2, spec_tokens=1,
                spec_requests=16, spec_seqs=8, structured_tokens=64)
MID_WORKLOAD = dict(max_len=8192, chunk=256, page=64, prompt_min=128, prompt_max=1024, requests=16, rate=1.0)


def workload(args, seed: int):
  """[(arrival s, prompt ids, output tokens)] sorted by arrival: Poisson arrivals, prompt lengths
  uniform, output lengths log-uniform (many short answers, a few long ones)."""
  rng = np.random.default_rng(seed)
  t = np.cumsum(rng.exponential(1.0 / args.rate, args.requests))
  t -= t[0]
  out = np.exp(rng.uniform(np.log(args.out_min), np.log(args.out_max + 1), args.requests)).astype(int)
  return [(float(a), [1] + rng.integers(3, 500, rng.integers(args.prompt_min, args.prompt_max + 1) - 1).tolist(),
           int(n)) for a, n in zip(t, out)]


def stats(first, finish, arrival, counts, t0, t1):
  ttft = np.array([f - a for f, a in zip(first, arrival)])
  tpot = np.array([(e - f) / max(n - 1, 1) for f, e, n in zip(first, finish, counts)])
  in_flight = sum(e - a for e, a in zip(finish, arrival)) / (t1 - t0)  # mean requests between arrival and finish
  return {"tokens_per_s": sum(counts) / (t1 - t0), "in_flight": in_flight, "ttft_p50": float(np.percentile(ttft, 50)),
          "ttft_p99": float(np.percentile(ttft, 99)), "tpot_p50": float(np.percentile(tpot, 50)),
          "tpot_p99": float(np.percentile(tpot, 99))}


def serve(engine: ServingEngine, work, policy: str, seqs: int):
  """The workload in real time through the engine -> stats. policy "continuous": a request joins the running
  batch at the next step after it arrives and leaves it when done. "static" (the JSON's ratios' baseline): when
  the engine is idle, every request that has arrived (up to seqs) forms one batch, which runs until its longest
  request is done, every row computing to the end (the old engine's finished rows kept decoding: each request runs
  to the batch's longest output, only its own tokens counting); later arrivals wait for the next batch.
  "static-shrink": the same batches, a finished request leaving its batch (throughput_ratio_vs_shrinking)."""
  n = len(work)
  first, finish, made = [None] * n, [None] * n, [0] * n
  requests, nxt = {}, 0
  t0 = time.perf_counter()
  while nxt < n or not engine.idle:
    now = time.perf_counter() - t0
    if policy == "continuous" or engine.idle:
      batch = [i for i in range(nxt, n) if work[i][0] <= now][:n if policy == "continuous" else seqs]
      longest = max((work[i][2] for i in batch), default=0)
      for i in batch:
        out = longest if policy == "static" else work[i][2]
        requests[id(engine.add_request(work[i][1], SamplingParams(max_tokens=out, ignore_eos=True)))] = i
      nxt += len(batch)
    if engine.idle:
      time.sleep(max(0.0, min(0.01, work[nxt][0] - now)))
      continue
    for r, _ in engine.step():
      i, t = requests[id(r)], time.perf_counter() - t0
      made[i] += 1
      if first[i] is None:
        first[i] = t
      if made[i] == work[i][2]:
        finish[i] = t
  t1 = time.perf_counter() - t0
  engine.scheduler.take_finished()
  return stats(first, finish, [w[0] for w in work], [w[2] for w in work], 0.0, t1)


def model_for(args, extra: dict, seqs: int):
  keys = dict(ici_data_parallelism=1, mtp_num_layers=0, max_target_length=args.max_len,
              max_prefill_length=args.max_len, prefill_chunk_size=args.chunk, serve_max_num_seqs=seqs,
              serve_max_num_tokens=args.tokens, serve_page_size=args.page)
  cfg = pyconfig.initialize(["bench", "base.yml"], num_devices=1, **{**keys, **extra})
  graphdef, params, buffers, _ = model_state.create(cfg, sharding.create_mesh(cfg))
  return cfg, graphdef, params, buffers


def served(args, extra: dict, seqs: int, work, runs: dict) -> dict:
  """The work through one engine (model_for's; every step program compiled before the clock starts), once per run
  {name: (policy, prefix caching on)}, reset between runs (empty pools and prefix cache; the programs stay)."""
  engine = ServingEngine(*model_for(args, extra, seqs))
  engine.warmup()
  out = {}
  for name, (policy, caching) in runs.items():
    engine.reset()
    engine.allocator.prefix_caching = caching
    out[name] = serve(engine, work, policy, seqs)
  return out


def compare(args, name: str, extra: dict, **overrides) -> dict:
  """Every policy on one workload; overrides: the workload's own args (e.g. MID_WORKLOAD)."""
  args = argparse.Namespace(**{**vars(args), **overrides})
  return {"model": name, **served(args, extra, args.seqs, workload(args, seed=0), {p: (p, True) for p in POLICIES})}


def prefix(args, extra: dict) -> dict:
  """TTFT of requests sharing a `system`-token system prompt (each + a short question), one at a time
  (`prefix_gap` s apart), without and with the prefix cache."""
  rng = np.random.default_rng(1)
  system = [1] + rng.integers(3, 500, args.system - 1).tolist()
  work = [(args.prefix_gap * i, system + rng.integers(3, 500, 8).tolist(), 8) for i in range(args.prefix_requests)]
  return served(args, {**extra, "max_target_length": args.system + 64}, 2, work,  # one request at a time
                {"without": ("continuous", False), "with": ("continuous", True)})


def speculative(args) -> dict:
  """A tiny-width model of --spec-layers decoder layers with one MTP module, trained on the progressions; at each
  of --spec-checkpoints training steps (an MTP module drafts better as it trains: a ladder of acceptance rates) the
  same requests served greedy with and without MTP drafts, side by side (--spec-repeats times each, interleaved;
  the median tokens/s), the weights swapped into the same two engines (load_weights: nothing recompiled)."""
  keys = dict(ici_data_parallelism=1, mtp_num_layers=1, max_target_length=160, dataset_type="synthetic",
              steps=max(args.spec_checkpoints), max_prefill_length=96, prefill_chunk_size=0,
              num_decoder_layers=args.spec_layers, serve_max_num_seqs=args.spec_seqs, serve_max_num_tokens=args.tokens,
              serve_page_size=args.page)
  cfg = pyconfig.initialize(["bench", "base.yml"], num_devices=1, **keys)
  graphdef, state, _, tx = train.init_state(cfg, sharding.create_mesh(cfg))
  step, data = jax.jit(train.make_train_step(cfg, graphdef, tx), donate_argnums=(0,)), create_data_iterator(cfg)
  t0, snapshots = time.perf_counter(), {}
  for i in range(1, cfg.steps + 1):
    state, metrics = step(state, train.prepare_batch(cfg, next(data)))
    if i in args.spec_checkpoints:  # a copy: the next step donates the state
      snapshots[i] = jax.tree.map(jnp.copy, (state["params"], state["buffers"]))
  trained = {k: round(float(metrics[k]), 3) for k in ("lm_loss", "mtp_loss", "accuracy")}
  trained["seconds"] = round(time.perf_counter() - t0, 1)
  rng = np.random.default_rng(2)
  rows = SyntheticBatches(cfg, 0, 1, salt=0x5EC)  # progressions for prompts: random starts and steps
  work = [(0.0, rows.row(0, i)["inputs"][:int(rng.integers(8, 33))].tolist(), int(rng.integers(16, 65)))
          for i in range(args.spec_requests)]
  engines = {}
  for k in (0, args.spec_tokens):
    engines[k] = ServingEngine(pyconfig.initialize(["bench", "base.yml"], num_devices=1, **keys,
                                                   serve_speculative_tokens=k), graphdef, *snapshots[cfg.steps])
    engines[k].warmup()
  ladder = []
  for at in sorted(snapshots):
    runs = {0: [], args.spec_tokens: []}
    for k in runs:
      engines[k].load_weights(*snapshots[at])
    for _ in range(args.spec_repeats):
      for k, eng in engines.items():  # every request at once: decode speed, not the arrival rate
        eng.reset()
        runs[k].append(serve(eng, work, "continuous", args.spec_seqs) | {"acceptance": eng.stats()["spec_acceptance"]})
    median = {k: sorted(r, key=lambda m: m["tokens_per_s"])[len(r) // 2] for k, r in runs.items()}
    ladder.append({"step": at, "acceptance": median[args.spec_tokens]["acceptance"],
                   "without": median[0], "with": median[args.spec_tokens],
                   "speedup": median[args.spec_tokens]["tokens_per_s"] / median[0]["tokens_per_s"]})
  return {"train": trained, "ladder": ladder, "acceptance": ladder[-1]["acceptance"], "speedup": ladder[-1]["speedup"]}


STRUCTURED_REGEX = "([a-z]+ )+"  # never complete: a constrained row runs to max_tokens like a free one


def structured(args) -> dict:
  """`seqs` free rows with 0, 1 and 8 regex-constrained rows beside them, all at once, side by side in one
  engine (its plain and masked step programs compiled first): tokens/s of all rows and of the free ones,
  the mask fill's milliseconds a step; the median of --spec-repeats interleaved runs."""
  tok = load_tokenizer(tokenizer_type="hf", tokenizer_path="tests/data/tokenizer.json")
  counts = (0, 1, 8)
  cfg, g, p, b = model_for(argparse.Namespace(**{**vars(args), "max_len": 128, "chunk": 32, "page": 16}), {},
                           args.seqs + max(counts))
  grammars = Grammars.for_tokenizer(tok, cfg.vocab_size)
  eng = ServingEngine(cfg, g, p, b, sample_vocab=tok.vocab_size, eos_id=tok.eos_id, grammars=grammars)
  eng.warmup()
  rng = np.random.default_rng(3)
  prompts = [rng.integers(3, tok.vocab_size, 16).tolist() for _ in range(args.seqs + max(counts))]
  spec = GrammarSpec("regex", STRUCTURED_REGEX, "structured_outputs")
  fill = grammars.mask
  spent = []

  def timed_fill(*a):  # the host's share: llguidance filling the constrained rows' masks
    t = time.perf_counter()
    out = fill(*a)
    spent.append(time.perf_counter() - t)
    return out

  grammars.mask = timed_fill

  def run(c: int) -> dict:
    eng.reset()
    spent.clear()
    plist = [SamplingParams(max_tokens=args.structured_tokens, temperature=1.0, seed=i, ignore_eos=True,
                            grammar=spec if i >= args.seqs else None) for i in range(args.seqs + c)]
    t0 = time.perf_counter()
    reqs = eng.generate(prompts[:args.seqs + c], plist)
    dt = time.perf_counter() - t0
    free = sum(len(r.output) for r in reqs[:args.seqs])
    return {"tokens_per_s": sum(len(r.output) for r in reqs) / dt, "free_tokens_per_s": free / dt,
            "steps": eng.steps, "mask_ms_per_step": 1e3 * sum(spent) / max(eng.steps, 1)}

  for c in counts:  # compiles the masked variants (and checks the outputs) before the clock
    run(c)
  runs = {c: [] for c in counts}
  for _ in range(args.spec_repeats):
    for c in counts:
      runs[c].append(run(c))
  return {c: sorted(r, key=lambda m: m["tokens_per_s"])[len(r) // 2] for c, r in runs.items()}


def print_structured(args, st: dict) -> dict:
  print(f"structured outputs: {args.seqs} free rows + N regex-constrained rows, {args.structured_tokens} tokens "
        f"each, temperature 1, all at once; median of {args.spec_repeats}")
  print(f"{'constrained':>11} {'tok/s all':>9} {'tok/s free':>10} {'steps':>5} {'mask ms/step':>12}")
  for c, m in st.items():
    print(f"{c:>11} {m['tokens_per_s']:9.1f} {m['free_tokens_per_s']:10.1f} {m['steps']:>5} {m['mask_ms_per_step']:12.3f}")
  base = st[0]["free_tokens_per_s"]
  return {f"structured_free_ratio_{c}": round(m["free_tokens_per_s"] / base, 3) for c, m in st.items() if c} | {
      f"structured_mask_ms_{c}": round(m["mask_ms_per_step"], 3) for c, m in st.items() if c}


def fresh(result):
  """result, after dropping every compiled program (each section compiles its own engines': XLA:CPU
  maps a few pages per kernel, and a process is allowed 65530 maps)."""
  jax.clear_caches()
  gc.collect()
  return result


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--quick", action="store_true", help="the tiny model only, 64 requests, a 512-token system prompt")
  ap.add_argument("--structured-only", action="store_true", help="only the structured-outputs rows")
  ap.add_argument("--spec-layers", type=int, default=12, help="the speculative model's decoder layers (+ one MTP)")
  ap.add_argument("--spec-checkpoints", type=lambda v: list(map(int, v.split(","))), default=[100, 125, 150, 200, 300],
                  help="training steps at which drafting is measured (the last: spec_acceptance, spec_speedup)")
  ap.add_argument("--spec-repeats", type=int, default=3, help="runs of each side per checkpoint (median)")
  args = argparse.Namespace(**WORKLOAD, **vars(ap.parse_args()))
  if args.quick:
    args.requests, args.system = 64, 512
  if args.structured_only:
    print(json.dumps(print_structured(args, fresh(structured(args)))))
    return
  spec = fresh(speculative(args))
  k, tr = args.spec_tokens, spec["train"]
  print(f"speculative: {k} MTP draft(s) a step; tiny widths, {args.spec_layers} layers + 1 MTP module trained "
        f"{max(args.spec_checkpoints)} steps in {tr['seconds']} s (lm loss {tr['lm_loss']}, "
        f"mtp loss {tr['mtp_loss']}); {args.spec_requests} requests at once, {args.spec_seqs} sequences, median of {args.spec_repeats}")
  print(f"{'trained steps':>13} {'acceptance':>10} {'tok/s without':>13} {'tok/s with':>10} {'speedup':>7} "
        f"{'TPOT p50 without':>16} {'with':>7}")
  for point in spec["ladder"]:
    w, o = point["with"], point["without"]
    print(f"{point['step']:>13} {point['acceptance']:10.3f} {o['tokens_per_s']:13.1f} {w['tokens_per_s']:10.1f} "
          f"{point['speedup']:7.3f} {o['tpot_p50']:16.4f} {w['tpot_p50']:7.4f}")
  at_06 = [p["speedup"] for p in spec["ladder"] if p["acceptance"] >= 0.6]
  out = {"spec_acceptance": round(spec["acceptance"], 3), "spec_speedup": round(spec["speedup"], 3),
         "spec_min_speedup_at_acceptance_0.6": round(min(at_06), 3) if at_06 else None,
         "spec_ladder": [[round(p["acceptance"], 3), round(p["speedup"], 3)] for p in spec["ladder"]]}
  rows = [fresh(compare(args, "tiny", {}))]
  if not args.quick:
    rows.append(fresh(compare(args, "mid (8 layers, emb 512, 8K)", MID, **MID_WORKLOAD)))
  pre = fresh(prefix(args, {}))
  out |= print_structured(args, fresh(structured(args)))
  print(f"{args.requests} requests, Poisson {args.rate}/s, prompts {args.prompt_min}-{args.prompt_max}, "
        f"outputs {args.out_min}-{args.out_max} tokens, {args.seqs} sequences; greedy, EOS ignored"
        + ("" if args.quick else f"; mid: {MID_WORKLOAD}"))
  print(f"{'model':>24} {'policy':>13} {'tok/s':>8} {'in flight':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'TPOT p50':>9} {'TPOT p99':>9}")
  for r in rows:
    for policy in POLICIES:
      m = r[policy]
      print(f"{r['model']:>24} {policy:>13} {m['tokens_per_s']:8.1f} {m['in_flight']:9.1f} {m['ttft_p50']:9.3f} "
            f"{m['ttft_p99']:9.3f} {m['tpot_p50']:9.4f} {m['tpot_p99']:9.4f}")
  print(f"shared prefix ({args.system}-token system prompt, {args.prefix_requests} requests): TTFT p50 "
        f"{pre['without']['ttft_p50']:.3f} s without the prefix cache, {pre['with']['ttft_p50']:.3f} s with it")
  ratios = lambda r: {"throughput_ratio": round(r["continuous"]["tokens_per_s"] / r["static"]["tokens_per_s"], 3),
                      "ttft_p50_ratio": round(r["static"]["ttft_p50"] / r["continuous"]["ttft_p50"], 3),
                      "throughput_ratio_vs_shrinking": round(r["continuous"]["tokens_per_s"]
                                                             / r["static-shrink"]["tokens_per_s"], 3)}
  print(json.dumps({**ratios(rows[0]),
                    "prefix_ttft_ratio": round(pre["without"]["ttft_p50"] / pre["with"]["ttft_p50"], 3),
                    **out, "rows": {r["model"]: ratios(r) for r in rows}}))

if __name__ == "__main__":
  main()
