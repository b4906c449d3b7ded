"""Per-row LoRA adapters (layers/lora_rows.py: which row takes which slot; kernels/low_rank.py: the contractions) against float64 numpy: each row's delta is x A_k B_k of its own slot k
(slot 0, zeros, adds exactly nothing), and absorbed MLA's two deltas are absorb_q / unabsorb_out over the row's A_k B_k;
the prefix keys of different adapters never meet (page_allocator.page_hashes' root); serve_lora_adapters' bad
entries are one config line each; the server maps a request's model to its adapter slot and lists every adapter."""

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.config.types import ConfigError
from MaxText.inference.page_allocator import page_hashes
from MaxText.kernels import low_rank
from MaxText.layers import lora_rows
from tests.conftest import make_config
from tests.support.server_harness import scripted_server

HI = jax.lax.Precision.HIGHEST
SLOTS = np.array([2, 0, 1], np.int32)  # three rows: adapter 2, none, adapter 1


def _slot_stack(key, n, shape_a, shape_b):
  """A [n, ...], B [n, ...] random, slot 0 zeros (as served)."""
  ka, kb = jax.random.split(key)
  a = np.asarray(jax.random.normal(ka, (n, *shape_a)), np.float64)
  b = np.asarray(jax.random.normal(kb, (n, *shape_b)), np.float64)
  a[0], b[0] = 0, 0
  return a, b


def _slots(a: np.ndarray, b: np.ndarray) -> low_rank.LowRank:
  """A [n,in,r], B [n,r,out] slot-stacked (slot 0 zeros) as Linear.low_rank hands them: slots 1 .. n-1 and each row's
  one-hot slot, inside row_adapters."""
  return low_rank.LowRank(jnp.asarray(a[1:], jnp.float32), jnp.asarray(b[1:], jnp.float32),
                          lora_rows.slot_rows(len(SLOTS), a.shape[0]))


def test_each_row_adds_its_own_slots_delta_and_slot_0_adds_exactly_nothing():
  a, b = _slot_stack(jax.random.key(0), 3, (24, 4), (4, 10))  # A [n,in,r], B [n,r,out]
  x = np.asarray(jax.random.normal(jax.random.key(1), (3, 5, 24)), np.float64)  # [b,t,in]
  with lora_rows.row_adapters(jnp.asarray(SLOTS)):
    got = np.asarray(low_rank.delta(jnp.asarray(x, jnp.float32), _slots(a, b), jnp.float32, HI))  # [b,t,out]
  for row, k in enumerate(SLOTS):
    np.testing.assert_allclose(got[row], x[row] @ a[k] @ b[k], rtol=1e-5, atol=1e-5, err_msg=f"row {row}")
  assert not got[1].any()  # the row without an adapter: the base's output exactly


def test_absorbed_deltas_are_absorb_qs_and_unabsorb_outs_contractions_with_each_rows_wkv_b_adapter():
  h, nope, v, c = 2, 6, 5, 8
  a, b = _slot_stack(jax.random.key(2), 3, (c, 4), (4, h * (nope + v)))  # wkv_b's A [n,c,r], B [n,r,h*(nope+v)]
  q_nope = np.asarray(jax.random.normal(jax.random.key(3), (3, 2, h, nope)), np.float32)  # [b,t,h,nope]
  o_lat = np.asarray(jax.random.normal(jax.random.key(4), (3, 2, h, c)), np.float32)  # [b,t,h,c]
  f32 = lambda z: jnp.asarray(z, jnp.float32)  # noqa: E731
  with lora_rows.row_adapters(jnp.asarray(SLOTS)):
    dq = np.asarray(low_rank.absorbed_q_delta(f32(q_nope), _slots(a, b), nope, jnp.float32, HI))
    do = np.asarray(low_rank.absorbed_out_delta(f32(o_lat), _slots(a, b), nope, jnp.float32, HI))
  for row, k in enumerate(SLOTS):
    ab = (a[k] @ b[k]).reshape(c, h, nope + v)  # the adapter's update of wkv_b [c, h, nope+v]
    want_q = np.einsum("thd,chd->thc", q_nope[row], ab[..., :nope])  # absorb_q's contraction, float64
    want_o = np.einsum("thc,chv->thv", o_lat[row], ab[..., nope:])  # unabsorb_out's
    np.testing.assert_allclose(dq[row], want_q, rtol=1e-5, atol=1e-5, err_msg=f"row {row}")
    np.testing.assert_allclose(do[row], want_o, rtol=1e-5, atol=1e-5, err_msg=f"row {row}")


def test_a_slot_stacked_linear_outside_row_adapters_says_so():
  with pytest.raises(ValueError, match="outside lora_rows.row_adapters"):
    lora_rows.slot_rows(2, 3)


def test_prefix_keys_of_different_adapters_never_meet():
  tokens = list(range(20))
  base, a, b = (page_hashes(tokens, 4, root) for root in (b"", b"lora:1", b"lora:2"))
  assert len(base) == len(a) == 5 and not (set(base) & set(a) or set(a) & set(b) or set(base) & set(b))
  assert page_hashes(tokens, 4, b"lora:1") == a


@pytest.mark.parametrize("keys,said", [
    (dict(serve_lora_adapters=["a"]), "config key 'serve_lora_adapters' = \\['a'\\]: entry 'a' is not name=path"),
    (dict(serve_lora_adapters=["a=/x", "a=/y"]), "the name 'a' is given twice"),
    (dict(serve_lora_adapters=["deepseek3.2-tiny=/x"]), "names an adapter 'deepseek3.2-tiny', the base model's name"),
    (dict(serve_lora_adapters=["a=/x"], serve_speculative_tokens=1),
     "serve_lora_adapters with serve_speculative_tokens=1: the MTP drafter does not apply adapters yet"),
])
def test_a_bad_serve_lora_adapters_is_one_line(keys, said):
  with pytest.raises(ConfigError, match=said) as e:
    make_config(**keys)
  assert "\n" not in str(e.value)


def test_the_model_field_picks_the_adapter_and_v1_models_lists_each():
  with scripted_server(make_config(serve_lora_adapters=["sql=/runs/sql", "chat=/runs/chat/checkpoints/4"])) as (url, eng, _):
    models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m["root"], m["parent"]) for m in models] == [
        ("tiny", "tiny", None), ("sql", "/runs/sql", "tiny"), ("chat", "/runs/chat/checkpoints/4", "tiny")]
    for model, slot in (("chat", 2), ("sql", 1), ("tiny", 0), (None, 0)):
      body = {"prompt": [1, 2], "max_tokens": 1} | ({"model": model} if model else {})
      r = httpx.post(url + "/v1/completions", json=body, timeout=10)
      assert r.status_code == 200 and r.json()["model"] == (model or "tiny"), r.text
      assert eng.requests[-1].params.lora_adapter == slot, model
    r = httpx.post(url + "/v1/completions", json={"prompt": [1], "model": "sqll"}, timeout=10)
    err = r.json()["error"]
    assert r.status_code == 404 and err["param"] == "model" and err["code"] == "model_not_found", r.text
    assert "'tiny', 'sql', 'chat'" in err["message"]
