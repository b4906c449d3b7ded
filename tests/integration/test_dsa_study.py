"""benchmarks/dsa_study.py end to end at a micro scale: the recipe's stages chain through
checkpoints (dense -> dense_warmup -> sparse), each arm is evaluated and measured, and the last
line printed is the JSON of accuracies. The study's findings are docs/dsa_study.md, not asserted."""

import json
import os
import sys

import pytest
import yaml

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")


@pytest.fixture(scope="module")
def dsa_study():
  sys.path.insert(0, BENCHMARKS)
  try:
    import dsa_study
  finally:
    sys.path.remove(BENCHMARKS)
  return dsa_study


def test_the_recipe_chains_its_stages_and_prints_every_arm(dsa_study, tmp_path, capsys, monkeypatch):
  micro = dsa_study.Scale(seq=32, topk=4, steps=3, warmup=1, sparse=1, batch=8, eval_steps=1,
                          task=("retrieval_pairs=2", "retrieval_queries=2", "retrieval_keys=4", "retrieval_values=3",
                                "retrieval_pair_tokens=1", "vocab_size=64"),
                          model=dsa_study.MODEL)
  monkeypatch.setitem(dsa_study.SCALES, "quick", micro)
  out = tmp_path / "study"
  dsa_study.main(["--quick", "--arms", "dense", "warmup_then_sparse", "--out", str(out)])
  printed = capsys.readouterr().out.strip().splitlines()
  accuracy = json.loads(printed[-1])
  assert list(accuracy) == ["dense", "warmup_then_sparse"] and all(0 <= a <= 1 for a in accuracy.values())
  assert any(line.startswith("| warmup_then_sparse | dense 1 + dense_warmup 1 + sparse 1 |") for line in printed)

  def config(run):
    return yaml.safe_load((out / run / "config.yml").read_text())

  assert config("dense")["indexer_topk"] == 32 and config("dense")["indexer_training_stage"] == "none"
  warm, sparse = config("dense_warmup"), config("warmup_then_sparse")
  assert warm["indexer_training_stage"] == "dense_warmup" and warm["indexer_topk"] == 4
  assert warm["load_parameters_path"] == str(out / "dense" / "checkpoints" / "1")  # the dense run at N - W - S
  assert sparse["indexer_training_stage"] == "sparse" and sparse["load_parameters_path"] == str(
      out / "dense_warmup" / "checkpoints")
  assert sorted(os.listdir(out / "dense" / "checkpoints")) == ["1", "2", "3"]
  with pytest.raises(SystemExit, match="not empty"):  # a rerun never resumes or overwrites a study
    dsa_study.main(["--quick", "--out", str(out)])
