"""GRPO's reference policy (rl_beta > 0): log pi_ref [N,T] of a step's rollouts, for the KL term.

    reference = Reference(config, graphdef, state, sample_vocab)   # the starting policy
    logp_ref = reference(state, arrays)                            # one forward, no gradient

Full fine-tune: the reference is a copy of the starting params (train state {"params", "buffers"}): one
more copy of the weights, held for the whole run.
LoRA (lora_rank > 0, train state {"params": adapters, "buffers": {}, "frozen": the base}): the reference is
the base with the adapters switched off: the graphdef of the same model without adapters (the one
lora_rank=0 builds; adapters are added after the base, so the base's tree is the same) over
state["frozen"], the very arrays the policy reads. No copy: rl_beta > 0 costs one forward a step and no
memory (`held_bytes` is 0). Its logprobs are the base model's bit for bit, and the policy's forward's while
B = 0 (step 0: KL 0; scored inside the train step's gradient program, another XLA program, the policy's may
round differently, ~1e-7: the demo's step-1 KL was -1.8e-10). The arrays are read from the state at each call: the train step donates the state,
so the frozen arrays of an earlier state are gone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from MaxText.checkpoint import model_state, orbax_state
from MaxText.config.types import Config
from MaxText.post_train.rollout_batch import scored_logprobs


class Reference:
  """The frozen reference policy of a run, scoring a batch's tokens as the trainer scores the policy's."""

  def __init__(self, config: Config, graphdef, state: dict, sample_vocab: int | None):
    self.lora = bool(config.lora_rank)
    if self.lora:  # the base with the adapters off: its graphdef, no weights of its own
      self.graphdef, self.params = model_state.abstract_model(config.model_copy(update={"lora_rank": 0}))[0], {}
    else:  # the starting policy, copied before the first update moves the params
      self.graphdef, self.params = graphdef, jax.tree.map(jnp.copy, state["params"])
    self._logprobs = jax.jit(lambda p, b, arrays: scored_logprobs(
        config, model_state.merge(self.graphdef, p, b), arrays, sample_vocab))

  def weights(self, state: dict) -> tuple[dict, dict]:
    """(params, buffers) the reference model merges: under LoRA ({}, the state's frozen base), else (the
    copy, the state's buffers)."""
    return (self.params, state[orbax_state.FROZEN]) if self.lora else (self.params, state["buffers"])

  def held_bytes(self) -> int:
    """Bytes of weights the reference holds beside the train state: 0 under LoRA, the params' otherwise."""
    return model_state.param_bytes(self.params)

  def describe(self) -> str:
    if self.lora:
      return "reference policy: the base with the adapters off (no copy of the weights; one forward a step)"
    return (f"reference policy: a copy of the starting parameters ({self.held_bytes() / 2**20:.1f} MiB; "
            "lora_rank > 0 would need none)")

  def __call__(self, state: dict, arrays: dict) -> jax.Array:
    """log pi_ref [N,T] of `arrays` (rollout_batch's, on the device) under the reference."""
    return self._logprobs(*self.weights(state), arrays)


__all__ = ["Reference"]
