"""A synthetic conversation set for the SFT demo: two-digit additions a tiny model learns on the CPU.

    python demos/sft_conversations.py --out /tmp/sft --train 2000 --eval 100 --tool_share 0.25 [--ops '*-']

Writes <out>/train.jsonl and <out>/eval.jsonl (use_sft=true, train_data_columns=[messages]). Each
conversation asks "a+b=?"; the assistant thinks in one short line ("a+b: units u, carry c": the units
column's result, its units digit and its carry) and answers the sum. A share of them give the assistant
the `add` tool: it calls add(a, b), receives the result and answers it. --ops '*-' writes products and
differences instead (each conversation one of them, a difference's larger operand first), in the same
format, where the tool conversations are products calling `mul` (the first op's tool; the others never
call one): the SFT demo's base task. Prints a table and one JSON line (the counts).
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import random

ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "a + b",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
# op -> (its tool's name, the operation); the tool is ADD_TOOL renamed (its description says the op).
OPS = {"+": ("add", operator.add), "*": ("mul", operator.mul), "-": ("sub", operator.sub)}


def tool_of(op: str) -> dict:
  name = OPS[op][0]
  return {"type": "function", "function": {**ADD_TOOL["function"], "name": name, "description": f"a {op} b"}}


def conversation(rng: random.Random, tool: bool, low: int = 10, high: int = 100, op: str = "+") -> dict:
  """Operands a, b in [low, high) (for "-": a >= b, so no result is negative)."""
  a, b = rng.randrange(low, high), rng.randrange(low, high)
  if op == "-" and a < b:
    a, b = b, a
  name, fn = OPS[op]
  r = str(fn(a, b))
  user = {"role": "user", "content": f"{a}{op}{b}=?"}
  if not tool:
    units = fn(a % 10, b % 10)
    think = f"{a}{op}{b}: units {units % 10}, carry {units // 10}"
    return {"messages": [user, {"role": "assistant", "reasoning_content": think, "content": r}]}
  call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": json.dumps({"a": a, "b": b})}}
  return {"tools": [tool_of(op)], "messages": [
      user, {"role": "assistant", "reasoning_content": f"use {name}", "content": "", "tool_calls": [call]},
      {"role": "tool", "tool_call_id": "call_0", "content": r},
      {"role": "assistant", "reasoning_content": "got it", "content": r}]}


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--train", type=int, default=2000)
  p.add_argument("--eval", type=int, default=100)
  p.add_argument("--tool_share", type=float, default=0.25)
  p.add_argument("--eval_tool_share", type=float, default=None, help="the eval set's (default: --tool_share)")
  p.add_argument("--low", type=int, default=10, help="smallest operand")
  p.add_argument("--high", type=int, default=100, help="operands are below this")
  p.add_argument("--seed", type=int, default=0)


def write_sets(args, out: str, ops: str = "+") -> dict:
  """Writes <out>/train.jsonl and <out>/eval.jsonl -> {split: {conversations, with_tools}}: each conversation asks
  one of `ops` at random. A --tool_share of the conversations of ops[0] (the first op) call its tool; the other ops'
  never do. With one op (the default "+") no random draw picks it, so the sets are those of the demo before `ops`."""
  rng = random.Random(args.seed)
  os.makedirs(out, exist_ok=True)
  counts = {}
  if not ops or set(ops) - set(OPS):
    raise SystemExit(f"error: --ops {ops!r}: one or more of {''.join(OPS)}")
  eval_share = args.tool_share if args.eval_tool_share is None else args.eval_tool_share
  for split, n, share in (("train", args.train, args.tool_share), ("eval", args.eval, eval_share)):
    rows = []
    for _ in range(n):
      op = rng.choice(ops) if len(ops) > 1 else ops
      rows.append(conversation(rng, rng.random() < share and op == ops[0], args.low, args.high, op))
    with open(os.path.join(out, f"{split}.jsonl"), "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
    counts[split] = {"conversations": n, "with_tools": sum("tools" in r for r in rows)}
  return counts


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True)
  add_arguments(p)
  p.add_argument("--ops", default="+", help=f"the operations asked, each conversation one at random, of {''.join(OPS)}; "
                                            "only the first one's conversations call its tool")
  args = p.parse_args()
  counts = write_sets(args, args.out, args.ops)
  print(f"{'split':<8}{'conversations':>15}{'with tools':>12}")
  for split, c in counts.items():
    print(f"{split:<8}{c['conversations']:>15}{c['with_tools']:>12}")
  print(json.dumps({"out": args.out, **{f"{s}_{k}": v for s, c in counts.items() for k, v in c.items()}}))


if __name__ == "__main__":
  main()
