"""checkpoint/orbax_state's fingerprint: the one check that sees a corruption leaving every value finite."""

import jax.numpy as jnp
import numpy as np

from MaxText.checkpoint import orbax_state


def test_one_low_mantissa_bit_in_any_leaf_changes_the_fingerprint_and_nothing_else():
  rng = np.random.default_rng(0)
  tree = {"params": {"w": rng.standard_normal((4, 8)).astype(np.float32),
                     "e": rng.standard_normal((8,)).astype(jnp.bfloat16)},
          "opt": {"count": np.int32(7), "mu": rng.standard_normal((3,)).astype(np.float32)}}
  fingerprint, finite = orbax_state.state_check(tree)
  assert bool(finite)
  uint = {2: np.uint16, 4: np.uint32}
  for path, flip in [(("params", "w"), 13), (("params", "e"), 5), (("opt", "count"), 0), (("opt", "mu"), 0)]:
    leaf = np.asarray(tree[path[0]][path[1]])
    bits = leaf.view(uint[leaf.dtype.itemsize]).copy()
    bits.reshape(-1)[flip] ^= 1  # the lowest mantissa bit of one value: still finite, all but equal
    changed = {**tree, path[0]: {**tree[path[0]], path[1]: bits.view(leaf.dtype).reshape(leaf.shape)}}
    got, still_finite = orbax_state.state_check(changed)
    assert bool(still_finite) and int(got) != int(fingerprint), path
    assert orbax_state._check_restored(changed, {"fingerprint": int(fingerprint)}).startswith(
        "its contents do not match the fingerprint"), path
  assert orbax_state._check_restored(tree, {"fingerprint": int(fingerprint)}) is None
