"""Float64 numpy references for the attention layers, and the tiny layers they are checked on (test_indexer.py,
test_attention_mla.py, test_sparse_attention.py): the lightning indexer's scores, RoPE (half-split and
interleaved), the norms, MLA, the top-k set, the indexer's KL; copies of our indexer into Hugging Face's."""

import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from MaxText.layers.attention_mla import MLA
from MaxText.layers.embeddings import rope_inv_freq
from MaxText.layers.indexer import Indexer
from tests.conftest import make_config


def np_index_scores_of(q, w, k, valid):
  """float64 oracle: I[t,s] = sum_h w[t,h] * d**-0.5 * relu(q[t,h] . k[s]); -inf where not valid."""
  q, w, k = (np.asarray(a, np.float64) for a in (q, w, k))
  d = q.shape[-1]
  dots = np.einsum("bthd,bsd->btsh", q, k)  # [b,t,s,h]
  out = np.einsum("btsh,bth->bts", np.maximum(dots, 0.0), w) * d ** -0.5
  return np.where(np.asarray(valid), out, -np.inf)


def np_rope_half(x, positions, inv_freq):
  """numpy rotate-half RoPE on all of x's last dim: x [b,t,...,r]."""
  x = np.asarray(x, np.float64)
  ang = np.asarray(positions, np.float64)[..., None] * np.asarray(inv_freq, np.float64)  # [b,t,r/2]
  ang = ang.reshape(ang.shape[:2] + (1,) * (x.ndim - 3) + ang.shape[-1:])
  c, s = np.cos(ang), np.sin(ang)
  h = x.shape[-1] // 2
  x1, x2 = x[..., :h], x[..., h:]
  return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def np_layernorm(x, scale, bias, eps=1e-6):
  x = np.asarray(x, np.float64)
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + eps) * np.asarray(scale, np.float64) + np.asarray(bias, np.float64)


def hf_indexer_config(cfg, topk):
  from transformers import DeepseekV32Config
  hf = DeepseekV32Config(
      vocab_size=cfg.vocab_size, hidden_size=cfg.emb_dim, intermediate_size=cfg.mlp_dim,
      moe_intermediate_size=cfg.moe_mlp_dim, num_hidden_layers=1, num_attention_heads=cfg.num_query_heads,
      num_key_value_heads=cfg.num_query_heads, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
      qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
      index_n_heads=cfg.indexer_n_heads, index_head_dim=cfg.indexer_head_dim, index_topk=topk,
      max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.normalization_layer_epsilon,
      first_k_dense_replace=1, n_group=1, topk_group=1, n_routed_experts=cfg.num_experts,
      num_experts_per_tok=cfg.num_experts_per_tok,
      rope_parameters=dict(rope_type="yarn", rope_theta=cfg.rope_max_timescale, factor=cfg.rope_factor,
                           original_max_position_embeddings=cfg.original_max_position_embeddings,
                           beta_fast=cfg.beta_fast, beta_slow=cfg.beta_slow, mscale=cfg.mscale,
                           mscale_all_dim=cfg.mscale))
  hf._attn_implementation = "eager"
  return hf


def to_torch(a):
  import torch
  return torch.from_numpy(np.array(a, np.float32))


def copy_indexer_to_hf(idx: Indexer, hf_idx):
  """Our kernels are [in, out]; torch Linear weights are [out, in]."""
  import torch
  with torch.no_grad():
    hf_idx.wq_b.weight.copy_(to_torch(idx.wq_b.kernel[...]).T)
    hf_idx.wk.weight.copy_(to_torch(idx.wk.kernel[...]).T)
    hf_idx.weights_proj.weight.copy_(to_torch(idx.weights_proj.kernel[...]).T)
    hf_idx.k_norm.weight.copy_(to_torch(idx.k_norm.scale[...]))
    hf_idx.k_norm.bias.copy_(to_torch(idx.k_norm.bias[...]))


MAIN = ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo")


T = 12  # one sequence length for most tests: compiled programs are shared


def rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.linalg.norm(got - want) / np.linalg.norm(want)


def make_mla(seed=0, **overrides):
  cfg = make_config(**overrides)
  m = MLA(cfg, rngs=nnx.Rngs(seed))
  rng = np.random.default_rng(seed + 100)
  # non-trivial norm scales, and weights large enough that attention is far from uniform
  if cfg.q_lora_rank:
    m.q_norm.scale[...] = jnp.asarray(1 + 0.3 * rng.standard_normal(cfg.q_lora_rank), jnp.float32)
  m.kv_norm.scale[...] = jnp.asarray(1 + 0.3 * rng.standard_normal(cfg.kv_lora_rank), jnp.float32)
  for name in MAIN + ("wq",):
    if not hasattr(m, name):
      continue
    lin = getattr(m, name)
    lin.kernel[...] = jnp.asarray(rng.standard_normal(lin.kernel.shape) / math.sqrt(lin.kernel.shape[0]), jnp.float32)
  if m.indexer is not None:
    m.indexer.k_norm.scale[...] = jnp.asarray(1 + 0.3 * rng.standard_normal(cfg.indexer_head_dim), jnp.float32)
    m.indexer.k_norm.bias[...] = jnp.asarray(0.3 * rng.standard_normal(cfg.indexer_head_dim), jnp.float32)
  return cfg, m


def mla_inputs(cfg, b=2, t=T, seed=0, offset=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((b, t, cfg.emb_dim)), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + offset, (b, t))
  return x, pos


def np_rms(x, scale, eps):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * np.asarray(scale, np.float64)


def np_rope_interleaved(x, positions, inv_freq):  # x [b,t,...,r]
  ang = np.asarray(positions, np.float64)[..., None] * np.asarray(inv_freq, np.float64)  # [b,t,r/2]
  ang = ang.reshape(ang.shape[:2] + (1,) * (x.ndim - 3) + ang.shape[-1:])
  x1, x2 = x[..., 0::2], x[..., 1::2]
  out = np.empty_like(x)
  out[..., 0::2] = x1 * np.cos(ang) - x2 * np.sin(ang)
  out[..., 1::2] = x2 * np.cos(ang) + x1 * np.sin(ang)
  return out


def np_mla(m: MLA, x, positions, mask, with_probs=False):
  """float64 oracle of the whole layer under a boolean mask [b,t,s] -> out [b,t,D]
  (and the attention probabilities [b,h,t,s] with_probs)."""
  cfg = m.config
  w = {n: np.asarray(getattr(m, n).kernel[...], np.float64) for n in MAIN + ("wq",) if hasattr(m, n)}
  x = np.asarray(x, np.float64)
  b, t, _ = x.shape
  h, nope, r, dv, c = cfg.num_query_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
  eps = 1e-6  # q_norm, kv_norm: DeepSeek's fixed eps, whatever normalization_layer_epsilon says
  inv = rope_inv_freq(cfg, r)
  q = x @ w["wq"] if "wq" in w else np_rms(x @ w["wq_a"], m.q_norm.scale[...], eps) @ w["wq_b"]
  q = q.reshape(b, t, h, nope + r)
  q_nope, q_pe = q[..., :nope], np_rope_interleaved(q[..., nope:], positions, inv)
  kv = x @ w["wkv_a"]
  c_kv, k_pe = np_rms(kv[..., :c], m.kv_norm.scale[...], eps), np_rope_interleaved(kv[..., c:], positions, inv)
  kvb = (c_kv @ w["wkv_b"]).reshape(b, t, h, nope + dv)
  k_nope, v = kvb[..., :nope], kvb[..., nope:]
  scale = (nope + r) ** -0.5
  if cfg.rope_type == "yarn" and cfg.rope_factor > 1:
    scale *= (0.1 * cfg.mscale * math.log(cfg.rope_factor) + 1.0) ** 2
  logits = (np.einsum("bthd,bshd->bhts", q_nope, k_nope) + np.einsum("bthr,bsr->bhts", q_pe, k_pe)) * scale
  mask = np.asarray(mask)[:, None]
  logits = np.where(mask, logits, -np.inf)
  mx = np.max(np.where(mask, logits, -1e300), -1, keepdims=True)
  e = np.where(mask, np.exp(logits - mx), 0.0)
  probs = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
  out = np.einsum("bhts,bshd->bthd", probs, v).reshape(b, t, h * dv)  # [b,t,h*v]
  return (out @ w["wo"], probs) if with_probs else out @ w["wo"]


def np_index_scores(m: MLA, x, positions, valid):
  """float64 oracle of the layer's indexer scores I [b,t,s] (-inf where not valid). The optional
  Hadamard rotation is orthogonal, so q . k, and the oracle, do without it."""
  cfg, idx = m.config, m.indexer
  x = np.asarray(x, np.float64)
  b, t, _ = x.shape
  r, inv = cfg.qk_rope_head_dim, rope_inv_freq(cfg, cfg.qk_rope_head_dim)
  kernel = lambda lin: np.asarray(lin.kernel[...], np.float64)
  q_lat = np_rms(x @ kernel(m.wq_a), m.q_norm.scale[...], 1e-6)  # [b,t,q_lora]
  q = (q_lat @ kernel(idx.wq_b)).reshape(b, t, cfg.indexer_n_heads, cfg.indexer_head_dim)  # [b,t,H,d]
  k = np_layernorm(x @ kernel(idx.wk), idx.k_norm.scale[...], idx.k_norm.bias[...])  # [b,s,d]
  q = np.concatenate([np_rope_half(q[..., :r], positions, inv), q[..., r:]], -1)
  k = np.concatenate([np_rope_half(k[..., :r], positions, inv), k[..., r:]], -1)
  w = x @ kernel(idx.weights_proj) * cfg.indexer_n_heads ** -0.5  # [b,t,H]
  return np_index_scores_of(q, w, k, valid)


def np_topk_mask(scores, k):
  """bool [b,t,s]: each row's min(k, #finite) highest scores, ties lowest position first (lax.top_k's set)."""
  order = np.argsort(-scores, axis=-1, kind="stable")[..., :k]  # [b,t,k]
  mask = np.zeros(scores.shape, bool)
  np.put_along_axis(mask, order, True, axis=-1)
  return mask & np.isfinite(scores)


def np_kl(probs, scores, support):
  p = np.asarray(probs, np.float64).sum(1)
  p = np.where(support, p, 0)
  p = p / p.sum(-1, keepdims=True)
  s = np.where(support, np.asarray(scores, np.float64), -np.inf)
  logq = s - s.max(-1, keepdims=True)
  logq = logq - np.log(np.exp(logq).sum(-1, keepdims=True))
  kl = np.where(support & (p > 0), p * (np.log(np.where(p > 0, p, 1)) - np.where(support, logq, 0)), 0).sum(-1)
  return kl.mean()
