"""benchmarks/decode.py --prompt: a prompt through the engine's chunked prefill, sparse and dense side by side on the
same parameters (issue 69's prefill figure), at CPU size: every chunk a row, the prompt's tokens/s per attention."""

import json

import pytest

from benchmarks import decode as bench

TINY = ["emb_dim=64", "mlp_dim=64", "moe_mlp_dim=32", "num_query_heads=2", "q_lora_rank=16", "kv_lora_rank=32",
        "qk_nope_head_dim=16", "qk_rope_head_dim=16", "v_head_dim=16", "indexer_n_heads=2", "indexer_head_dim=32"]


@pytest.mark.slow  # ~20 s of CPU: two engines' programs compiled
def test_prompt_runs_sparse_and_dense_chunks_over_the_whole_prompt(capsys):
  bench.main(["--prompt", "--prompt-attention", "sparse", "dense", "--contexts", "512", "--chunk", "128", "--topk",
              "64", "--set", *TINY])
  out = capsys.readouterr().out
  rows = json.loads(out.strip().splitlines()[-1])["rows"]
  for mode in ("sparse", "dense"):
    mine = [r for r in rows if r["attention"] == mode]
    assert [r["prefix"] for r in mine] == [0, 128, 256, 384]  # 511 prompt tokens in chunks of 128
    assert sum(r["tokens"] for r in mine) == 511 and all(r["ms"] > 0 for r in mine)
    assert f"context 512, {mode}: 511 prompt tokens in " in out
