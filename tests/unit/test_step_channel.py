"""The multi-process serving seam (MaxText/inference/step_channel.py): a message decodes to process 0's
arguments bit for bit; messages reach a follower in order through the key-value store (an in-memory
stand-in for jax.distributed's) and old ones are deleted; a follower's death is seen by process 0 at
once, process 0's by the follower; after "stop" a closed connection is no loss; one process sends
nothing; and a follower engine replaying process 0's messages computes exactly process 0's outputs
(greedy, seeded sampling, logprobs, penalties), so every input a step needs is in the message."""

import socket
import threading
import time

import numpy as np
import pytest

from MaxText.inference import step_channel
from MaxText.inference.step_channel import Channel, Diverged, Lockstep, decode, encode


class Store:
  """jax.distributed's key-value client, in memory (the calls the channel makes)."""

  def __init__(self):
    self.values, self.cond = {}, threading.Condition()

  def key_value_set(self, key, value):
    self.key_value_set_bytes(key, value)

  def key_value_set_bytes(self, key, value):
    with self.cond:
      self.values[key] = value
      self.cond.notify_all()

  def _get(self, key, timeout_in_ms):
    with self.cond:
      if not self.cond.wait_for(lambda: key in self.values, timeout_in_ms / 1000):
        raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
      return self.values[key]

  blocking_key_value_get = blocking_key_value_get_bytes = _get

  def key_value_delete(self, key):
    with self.cond:
      self.values.pop(key, None)


def test_a_message_decodes_to_the_arguments_bit_for_bit():
  buf = np.arange(24, dtype=np.int32).reshape(3, 8)
  buf[0, 0] = np.float32(0.7).view(np.int32)  # fp32 bits in the feed survive
  adjust = (np.array([[1, 2]], np.int32), np.full((1, 2, 3), 0.25, np.float32))
  op, args = decode(encode("step", (16, buf, True, False, None, adjust)))
  assert op == "step" and args[0] == 16 and args[2] is True and args[3] is False and args[4] is None
  np.testing.assert_array_equal(args[1], buf)
  assert args[1].dtype == np.int32 and args[1].flags.writeable
  assert isinstance(args[5], tuple) and args[5][1].dtype == np.float32
  np.testing.assert_array_equal(args[5][0], adjust[0])
  np.testing.assert_array_equal(args[5][1], adjust[1])


_OPEN: list = []  # the channels a test made: closed quietly after it


@pytest.fixture(autouse=True)
def ended(monkeypatch):
  """What a follower's `lost` was called with (it would exit the process)."""
  calls = []
  monkeypatch.setattr(step_channel, "lost", calls.append)
  yield calls
  for channel in _OPEN:
    channel.stopping = True  # its watcher now ignores the end
    for conn in channel._conns:
      conn.close()
  _OPEN.clear()


def _pair(store, processes=2, kind=Channel, timeout_s=10):
  """(process 0's Channel, process 1's), joined over the stand-in store and a localhost connection."""
  lost = []
  out = {}
  t = threading.Thread(target=lambda: out.setdefault(0, kind(store, 0, processes, "127.0.0.1", timeout_s,
                                                              on_lost=lost.append)))
  t.start()
  follower = kind(store, 1, processes, "127.0.0.1", timeout_s)
  t.join(10)
  _OPEN.extend([out[0], follower])
  return out[0], follower, lost


def test_messages_arrive_in_order_and_old_ones_are_deleted(monkeypatch):
  monkeypatch.setattr(step_channel, "WINDOW", 4)
  store = Store()
  main, follower, lost = _pair(store)
  got = []
  for i in range(10):  # a follower is at most a step behind (each step ends with a read every process joins)
    main.send("step", i, np.full((2, 3), i, np.int32))
    got.append(follower.receive())
  assert [a[0] for _, a in got] == list(range(10))
  assert all(op == "step" for op, _ in got)
  assert sorted(k for k in store.values if "/msg/" in k) == [f"maxtext_serve/msg/{i}" for i in range(6, 10)]
  main.close()
  assert follower.receive()[0] == "stop" and follower.stopping
  assert not lost


def test_a_dead_follower_is_seen_by_process_0_at_once():
  main, follower, lost = _pair(Store())
  follower._conns[0].shutdown(socket.SHUT_WR)  # what SIGKILL does to its socket: the other end reads its end
  deadline = time.monotonic() + 5
  while not lost and time.monotonic() < deadline:
    time.sleep(0.01)
  assert lost and "process 1 of 2 is gone" in lost[0] and main.failed
  main.close()  # after a loss no "stop": the others must see process 0 end and exit 1
  assert main.seq == 0


def test_a_dead_process_0_ends_its_follower(ended):
  main, follower, _ = _pair(Store())
  main._conns[0].shutdown(socket.SHUT_WR)
  deadline = time.monotonic() + 5
  while not ended and time.monotonic() < deadline:
    time.sleep(0.01)
  assert ended and "process 0 of 2 is gone" in ended[0]


def test_after_stop_a_closed_connection_is_the_normal_shutdown(ended):
  main, follower, lost = _pair(Store())
  main.close()
  assert follower.receive()[0] == "stop"
  follower._conns[0].shutdown(socket.SHUT_WR)
  main._conns[0].shutdown(socket.SHUT_WR)
  time.sleep(0.3)
  assert not lost and not ended


def test_one_process_sends_nothing():
  assert step_channel.open_channel(1) is step_channel.LOCAL
  assert not step_channel.LOCAL.multi and step_channel.LOCAL.main


# ---------------------------------------------------------------- Lockstep: every process runs the host logic (RL)


def test_lockstep_passes_equal_calls_and_stops_the_first_differing_one_on_its_process():
  main, follower, lost = _pair(Store(), kind=Lockstep)
  buf = np.arange(12, dtype=np.int32).reshape(3, 4)
  for i in range(3):
    main.send("step", 16, buf + i, True, None)
    follower.send("step", 16, buf + i, True, None)  # the same call: passes
  main.send("step", 16, buf, True, None)
  other = buf.copy()
  other[2, 3] += 1  # one int of the step feed
  with pytest.raises(Diverged, match=r"process 1's call 3 \(step\) is not process 0's"):
    follower.send("step", 16, other, True, None)
  follower.send("step", 16, buf, True, None)  # (a Diverged process exits; here it goes on, at call 3 still)
  main.send("reset")
  with pytest.raises(Diverged, match="call 4"):
    follower.send("step", 16, buf, True, None)  # another call than process 0's at the same point
  assert not lost


def test_from_main_runs_on_process_0_only_and_gives_every_process_its_value_bit_for_bit():
  main, follower, _ = _pair(Store(), kind=Lockstep)
  calls = []
  rewards = np.array([0.1, 1 / 3, -2.5], np.float32)
  assert main.from_main(lambda: calls.append(0) or rewards) is not None
  got = follower.from_main(lambda: calls.append(1) or np.zeros(3, np.float32))
  assert calls == [0] and got.dtype == np.float32 and got.tobytes() == rewards.tobytes()
  assert float(main.from_main(lambda: 0.25)) == float(follower.from_main(lambda: 1.0)) == 0.25
  main.send("reset")
  with pytest.raises(Diverged, match=r"call 2 \(from_main\)"):
    follower.from_main(lambda: 1.0)  # process 0 made a call here, not a value


def test_lockstep_close_waits_for_every_process_and_no_end_after_it_is_a_loss(ended):
  main, follower, lost = _pair(Store(), kind=Lockstep, timeout_s=1)
  with pytest.raises(RuntimeError, match="DEADLINE_EXCEEDED"):
    main.close()  # process 1 never said it is done: a bounded wait (timeout_s), then an error
  follower.close()
  main.close()
  follower._conns[0].shutdown(socket.SHUT_WR)
  main._conns[0].shutdown(socket.SHUT_WR)
  time.sleep(0.3)
  assert not lost and not ended


def test_a_lost_process_under_lockstep_ends_the_other_naming_rl(ended):
  main, follower, _ = _pair(Store(), kind=Lockstep)
  main._conns[0].shutdown(socket.SHUT_WR)
  deadline = time.monotonic() + 5
  while not ended and time.monotonic() < deadline:
    time.sleep(0.01)
  assert ended and ended[0].startswith("rl: process 0 of 2 is gone")


class Recorder:
  """Process 0's channel in one process: keeps each message as a follower would receive it."""
  main, multi = True, True

  def __init__(self):
    self.messages = []

  def send(self, op, *args):
    self.messages.append(decode(encode(op, args)))

  def receive(self):
    return self.messages.pop(0)


@pytest.mark.slow
def test_a_follower_replaying_the_messages_computes_process_0s_outputs():
  """The follower is the same engine, reset (empty pools, as a new one) with its channel LOCAL: it compiles
  nothing again, and its steps see only what the messages carry."""
  from MaxText.checkpoint import model_state
  from MaxText.inference.scheduler import SamplingParams
  from MaxText.inference.serving import ServingEngine
  from MaxText.runtime import sharding
  from tests.conftest import make_config
  from tests.support.serving import BASE, PROMPTS

  cfg = make_config(**BASE)
  graphdef, params, buffers, _ = model_state.create(cfg, sharding.create_mesh(cfg))
  engine = ServingEngine(cfg, graphdef, params, buffers, eos_id=-1)
  outputs = []
  run = engine.device_step
  engine.device_step = lambda *a: outputs.append(run(*a)) or outputs[-1]
  engine.channel = Recorder()
  options = [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, temperature=1.0, seed=5, top_p=0.8),
             SamplingParams(max_tokens=4, logprobs=2),
             SamplingParams(max_tokens=4, temperature=0.9, presence_penalty=1.5, logit_bias=((7, 5.0),))]
  engine.generate(PROMPTS[:4], options)
  engine.reset()
  messages, leader = engine.channel.messages, list(outputs)
  ops = [op for op, _ in messages]
  assert ops[-1] == "reset" and ops.count("step") == len(leader) > 3
  assert any(args[5] is not None for op, args in messages if op == "step")  # penalties travelled
  outputs.clear()
  engine.channel = step_channel.LOCAL
  inbox = Recorder()
  inbox.messages = messages + [("stop", ())]
  assert step_channel.follow(engine, inbox) == len(messages)
  assert len(outputs) == len(leader)
  for mine, theirs in zip(leader, outputs):
    np.testing.assert_array_equal(mine[0], theirs[0])  # the sampled tokens
    assert (mine[1] is None) == (theirs[1] is None)
    for a, b in zip(mine[1] or (), theirs[1] or ()):  # the logprobs
      np.testing.assert_array_equal(a, b)
