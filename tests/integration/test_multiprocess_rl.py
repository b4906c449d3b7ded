"""GRPO over several processes (docs/multihost.md "RL over several processes"): `MaxText/rl.py` on 2 processes
x 4 CPU devices (jax.distributed on localhost, gloo) runs the same rollouts and updates as 1 process x 8 devices;
processes started with different configs fail with one line before compiling; a process killed mid-run ends
the other at once.

Equal how: the rollouts bit for bit (every process runs the engine's host logic, Lockstep-checked, and reads the
same sampled tokens): rewards, completion lengths, advantages, routing agreement and the held-out reward before
any update are the same floats. The
losses, KL, gradient norms and parameters differ by float32 rounding only: the sums over the 8 data shards (the
loss's mean, the gradient) are reduced in another order across 2 processes (gloo) than inside one, and Adam
passes that on (measured: step 1's loss -3.7e-9 vs 0.0, step 2's 9e-9 apart; parameters 1.4e-6 apart at most
after 3 updates; an update moves a parameter by ~1e-2, so a lost or doubled row would be 1e-3 or more).

One fixture starts both runs at once (3 processes on the 2-core host); every wait is bounded (train_processes.
finish kills what outlives it). No persistent compilation cache for the 2-process run (train_processes.launch
says why)."""

import os
import signal
import threading
import time

import numpy as np
import pytest

from tests.support.rl_processes import STEPS, final_params, rl_args, scalars
from tests.support.train_processes import finish, launch, ok

ROLLOUT = ("reward_mean", "reward_std", "completion_tokens", "advantage_abs_mean", "routing_agreement",
           "learning_rate")  # computed from the rollouts (sums of quarters and counts: exact): bit-equal
# through the parameters the gradient's all-reduce made: float32 rounding (ratio_mean too: 0.99999994 vs 1.0 seen)
UPDATE = ("loss", "kl", "grad_norm", "param_norm", "ratio_mean")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """(1 process x 8 devices' folder, 2 processes x 4 devices' folder, the 2-process run's outputs)."""
  root = tmp_path_factory.mktemp("rl_multiprocess")
  cache = str(root / "jax_cache")
  one = launch("rl.py", rl_args(root / "one"), processes=1, devices=8, cache=cache)
  two = launch("rl.py", rl_args(root / "two"), processes=2, devices=4, cache=cache, timeout_s=120)
  try:
    results = finish(one), finish(two)
  finally:
    for p in one + two:  # the other run too, when one failed or timed out
      if p.poll() is None:
        p.kill()
  ok(results[0])
  return root / "one", root / "two", ok(results[1])


def test_two_processes_run_grpo_exactly_like_one_process_with_all_devices(runs):
  one, two, ((_, out, _), (_, silent, _)) = runs
  assert f"done: RL steps 1-{STEPS} of {STEPS}" in out and silent.strip() == ""  # process 0 alone speaks
  assert len(os.listdir(two / "r" / "tensorboard")) == 1  # and writes events
  want, got = scalars(one), scalars(two)
  for k in ROLLOUT:
    assert got[k] == want[k], k
  # the held-out reward (greedy completions; the reward shared by process 0): before any update, the same
  assert got["eval_reward"][0] == want["eval_reward"][0] and sorted(got["eval_reward"]) == [0, STEPS]
  assert want["kl"][1] == 0 and want["kl"][STEPS] > 0 and want["loss"][STEPS] != 0  # the policy moved
  for k in UPDATE:
    for s in range(1, STEPS + 1):
      assert got[k][s] == pytest.approx(want[k][s], rel=1e-5, abs=1e-7), (k, s)
  params, reference = final_params(two), final_params(one)
  assert params.keys() == reference.keys()
  for name, value in params.items():
    np.testing.assert_allclose(value, reference[name], rtol=0, atol=2e-5, err_msg=name)


def test_processes_with_different_configs_fail_with_one_line_before_compiling(tmp_path):
  procs = launch("rl.py", rl_args(tmp_path), processes=2, devices=4, cache=str(tmp_path / "cache"), timeout_s=60,
                 per_process={1: ["rl_beta=0.2"]})
  for rc, out, err in finish(procs, timeout=180):
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(lines) == 1, (rc, err[-2000:])
    assert "1 key(s) differ: rl_beta=0.1 on process 0, 0.2 on process 1" in lines[0]
    assert "serve:" not in out and "Traceback" not in err  # before the engine (and anything compiled)


def test_a_process_killed_mid_run_ends_the_other_within_seconds(tmp_path):
  """Process 1 is SIGKILLed once the engine is built (process 0 then compiles and runs the first rollout's
  steps, collectives included): process 0 sees its connection close and exits 1 with one line naming it."""
  procs = launch("rl.py", rl_args(tmp_path), processes=2, devices=4, cache=str(tmp_path / "cache"), timeout_s=120)
  engine_built = threading.Event()

  def watch():
    for line in procs[0].stdout:
      if line.startswith("serve: "):
        engine_built.set()

  threading.Thread(target=watch, daemon=True).start()
  try:
    assert engine_built.wait(400), "process 0 never built its engine"
    procs[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    assert procs[0].wait(timeout=60) == 1
    ended_s = time.monotonic() - killed
  finally:
    for p in procs:
      p.kill()
  err = procs[0].stderr.read()
  assert "error: rl: process 1 of 2 is gone (its connection closed: it died or was killed); exiting" in err, err[-2000:]
  assert ended_s < 10, ended_s
