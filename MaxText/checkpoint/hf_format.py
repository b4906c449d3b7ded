"""The Hugging Face DeepSeek-V3.2 checkpoint format, both directions, defined once: config.json keys
<-> our config keys, HF tensor names <-> paths in our (params, buffers) trees, and safetensors files.

convert_hf_checkpoint (HF -> ours) and export_hf_checkpoint (ours -> HF) both read these tables, so
a name added here is imported and exported alike. Our side is the UNSTACKED layout: each layer stack
as {"layers": {i: layer}} (what scan_layers=false builds); `stack_layers` / `unstack_layers` convert
from and to the scanned layout (params stacked on a leading layer axis).
"""

from __future__ import annotations

import glob
import json
import os
import struct
from typing import Any, NamedTuple

import jax
import ml_dtypes
import numpy as np

from MaxText.config.types import Config
from MaxText.layers.linears import SCALE_SUFFIX

KEY_VALUE_HELP = ("key=value arguments override config keys (e.g. scan_layers=false); every key, its default "
                  "and a one-line comment: configs/base.yml")

# ---------------------------------------------------------------- config.json <-> our keys
REQUIRED = object()  # an HF key the importer cannot do without

# (our key, HF config.json key, the HF value when config.json lacks the key)
CONFIG_KEYS: tuple[tuple[str, str, Any], ...] = (
    ("vocab_size", "vocab_size", REQUIRED),
    ("emb_dim", "hidden_size", REQUIRED),
    ("mlp_dim", "intermediate_size", REQUIRED),
    ("num_decoder_layers", "num_hidden_layers", REQUIRED),
    ("first_num_dense_layers", "first_k_dense_replace", 3),
    ("normalization_layer_epsilon", "rms_norm_eps", 1e-6),
    ("num_query_heads", "num_attention_heads", REQUIRED),
    ("q_lora_rank", "q_lora_rank", REQUIRED),
    ("kv_lora_rank", "kv_lora_rank", REQUIRED),
    ("qk_nope_head_dim", "qk_nope_head_dim", REQUIRED),
    ("qk_rope_head_dim", "qk_rope_head_dim", REQUIRED),
    ("v_head_dim", "v_head_dim", REQUIRED),
    ("max_position_embeddings", "max_position_embeddings", 163840),
    ("indexer_n_heads", "index_n_heads", REQUIRED),
    ("indexer_head_dim", "index_head_dim", REQUIRED),
    ("indexer_topk", "index_topk", REQUIRED),
    ("num_experts", "n_routed_experts", REQUIRED),
    ("num_experts_per_tok", "num_experts_per_tok", REQUIRED),
    ("n_routing_groups", "n_group", 1),
    ("topk_routing_group", "topk_group", 1),
    ("shared_experts", "n_shared_experts", 1),
    ("moe_mlp_dim", "moe_intermediate_size", REQUIRED),
    ("routed_scaling_factor", "routed_scaling_factor", 1.0),
    ("norm_topk_prob", "norm_topk_prob", True),
    ("mtp_num_layers", "num_nextn_predict_layers", 0),
)
# (our key, key in config.json's rope_parameters for rope_type=yarn, default)
YARN_KEYS: tuple[tuple[str, str, Any], ...] = (
    ("rope_factor", "factor", REQUIRED),
    ("original_max_position_embeddings", "original_max_position_embeddings", REQUIRED),
    ("beta_fast", "beta_fast", 32.0),
    ("beta_slow", "beta_slow", 1.0),
)
_FLOAT_KEYS = {"normalization_layer_epsilon", "routed_scaling_factor", "rope_factor", "beta_fast", "beta_slow"}
_BOOL_KEYS = {"norm_topk_prob"}


def _cast(ours: str, v):
  return float(v) if ours in _FLOAT_KEYS else bool(v) if ours in _BOOL_KEYS else int(v)


def _read(src: dict, table, where: str) -> dict:
  out = {}
  for ours, theirs, default in table:
    if theirs not in src and default is REQUIRED:
      raise ValueError(f"{where} has no '{theirs}' (needed for our {ours})")
    out[ours] = _cast(ours, src.get(theirs, default))
  return out


def config_from_hf(hf: dict) -> dict:
  """Our config keys from an HF DeepSeek-V3.2 config.json."""
  rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  out = _read(hf, CONFIG_KEYS, "config.json")
  out["first_num_dense_layers"] = min(out["first_num_dense_layers"], out["num_decoder_layers"])
  out["use_indexer"] = True
  out["rope_max_timescale"] = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
  if rope.get("rope_type", rope.get("type", "default")) == "yarn":
    m, m_all = rope.get("mscale", 1.0), rope.get("mscale_all_dim", 0)
    if m_all and m != m_all:
      raise ValueError(f"rope mscale={m} != mscale_all_dim={m_all}: cos/sin would carry an extra scale "
                       "we do not model (DeepSeek-V3.2 sets both to 1.0)")
    out.update(rope_type="yarn", **_read(rope, YARN_KEYS, "config.json rope_parameters"), mscale=float(m_all or 1.0))
  else:
    out.update(rope_type="default", rope_factor=1.0)
  return out


def quantization_from_hf(hf: dict) -> dict:
  """{"weight_block_size": [b_out, b_in]} of an fp8 checkpoint's quantization_config, else {}: the block
  its scales use, which weight_quantization=fp8_block must keep."""
  q = hf.get("quantization_config") or {}
  if q.get("quant_method") not in (None, "fp8") or q.get("fmt", "e4m3") != "e4m3":
    raise ValueError(f"config.json quantization_config {q}: only DeepSeek's fp8 (e4m3, block scales) is read")
  return {"weight_block_size": [int(b) for b in q["weight_block_size"]]} if "weight_block_size" in q else {}


def check_exportable(cfg: Config) -> None:
  """Raises ValueError naming the key when transformers' DeepseekV32ForCausalLM cannot hold the model."""
  need = {"attention_type": "mla", "use_indexer": True, "routed_score_func": "sigmoid"}
  for key, value in need.items():
    if getattr(cfg, key) != value:
      raise ValueError(f"{key}={getattr(cfg, key)!r}: DeepseekV32ForCausalLM needs {key}={value!r}")
  if cfg.num_moe_layers and not cfg.num_experts:
    raise ValueError(f"num_experts=0 with {cfg.num_moe_layers} MoE layers: DeepseekV32ForCausalLM needs experts "
                     "(or first_num_dense_layers=num_decoder_layers)")


def config_to_hf(cfg: Config, dtype: str) -> dict:
  """config.json for transformers' DeepseekV32ForCausalLM (and vLLM / SGLang): every key config_from_hf reads."""
  check_exportable(cfg)
  hf = {"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32"}
  hf.update({theirs: getattr(cfg, ours) for ours, theirs, _ in CONFIG_KEYS})
  hf.update(num_key_value_heads=cfg.num_query_heads, hidden_act="silu", tie_word_embeddings=False,
            attention_bias=False, scoring_func="sigmoid", topk_method="noaux_tc", dtype=dtype, torch_dtype=dtype)
  rope = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_max_timescale}
  if cfg.rope_type == "yarn":
    rope.update({theirs: getattr(cfg, ours) for ours, theirs, _ in YARN_KEYS})
    rope.update(mscale=cfg.mscale, mscale_all_dim=cfg.mscale)
  if cfg.weight_quantization == "fp8_block":  # DeepSeek-V3's own quantization_config
    hf["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                 "weight_block_size": list(cfg.weight_block_size)}
  hf["rope_parameters"] = rope  # transformers >= 5
  # The official DeepSeek config.json spelling, which vLLM / SGLang on older transformers read.
  hf["rope_theta"] = cfg.rope_max_timescale
  if cfg.rope_type == "yarn":
    hf["rope_scaling"] = {"type": "yarn", **{k: v for k, v in rope.items() if k not in ("rope_type", "rope_theta")}}
  return hf


# ---------------------------------------------------------------- tensor names <-> our paths
class Tensor(NamedTuple):
  """One HF tensor and where it lives in {"params": ..., "buffers": ...} (unstacked layout)."""
  hf: str
  ours: tuple  # path; with `expert`, the array holds all experts and this tensor is row `expert`
  linear: bool  # HF Linear weight [out,in] <-> our kernel [in,out]
  expert: int | None = None
  role: str = ""  # "bias": may be absent (zeros); "copy": a duplicate of a shared tensor, written on export only


_LINEAR = {"kernel", "gate_kernel"}
_ATTENTION = (  # HF name under model.layers.{i}. -> our path under the layer
    ("input_layernorm.weight", "pre_attention_norm.scale"),
    ("self_attn.q_a_proj.weight", "attention.wq_a.kernel"),
    ("self_attn.q_a_layernorm.weight", "attention.q_norm.scale"),
    ("self_attn.q_b_proj.weight", "attention.wq_b.kernel"),
    ("self_attn.kv_a_proj_with_mqa.weight", "attention.wkv_a.kernel"),
    ("self_attn.kv_a_layernorm.weight", "attention.kv_norm.scale"),
    ("self_attn.kv_b_proj.weight", "attention.wkv_b.kernel"),
    ("self_attn.o_proj.weight", "attention.wo.kernel"),
    ("self_attn.indexer.wq_b.weight", "attention.indexer.wq_b.kernel"),
    ("self_attn.indexer.wk.weight", "attention.indexer.wk.kernel"),
    ("self_attn.indexer.k_norm.weight", "attention.indexer.k_norm.scale"),
    ("self_attn.indexer.k_norm.bias", "attention.indexer.k_norm.bias"),
    ("self_attn.indexer.weights_proj.weight", "attention.indexer.weights_proj.kernel"),
    ("post_attention_layernorm.weight", "pre_mlp_norm.scale"),
)
_MLP = (("gate_proj.weight", "gate.kernel"), ("up_proj.weight", "up.kernel"), ("down_proj.weight", "down.kernel"))
_EXPERTS = (("gate_proj.weight", "wi_0"), ("up_proj.weight", "wi_1"), ("down_proj.weight", "wo"))  # our [E,D,I],[E,D,I],[E,I,D]
_MTP = (("enorm.weight", "embed_norm.scale"), ("hnorm.weight", "hidden_norm.scale"),
        ("eh_proj.weight", "projection.kernel"), ("shared_head.norm.weight", "final_norm.scale"))
_TOP = (("model.embed_tokens.weight", "embed.embedding"), ("model.norm.weight", "final_norm.scale"),
        ("lm_head.weight", "output_head.kernel"))


def _entry(hf: str, tree: str, base: tuple, dotted: str, **kw) -> Tensor:
  path = (tree, *base, *dotted.split("."))
  return Tensor(hf, path, path[-1] in _LINEAR, **kw)


def _layer_tensors(cfg: Config, idx: int, base: tuple, moe: bool) -> list[Tensor]:
  p = f"model.layers.{idx}."
  out = [_entry(p + hf, "params", base, ours) for hf, ours in _ATTENTION]
  if not moe:
    return out + [_entry(p + "mlp." + hf, "params", base, "mlp." + ours) for hf, ours in _MLP]
  out.append(_entry(p + "mlp.gate.weight", "params", base, "mlp.gate_kernel"))
  out.append(_entry(p + "mlp.gate.e_score_correction_bias", "buffers", base, "mlp.routing_bias", role="bias"))
  for e in range(cfg.num_experts):
    out += [Tensor(f"{p}mlp.experts.{e}.{hf}", ("params", *base, "mlp", ours), True, expert=e) for hf, ours in _EXPERTS]
  if cfg.shared_experts:
    out += [_entry(p + "mlp.shared_experts." + hf, "params", base, "mlp.shared_experts." + ours) for hf, ours in _MLP]
  return out


def tensor_map(cfg: Config) -> list[Tensor]:
  """Every HF tensor of the model `cfg` describes, in HF order (embedding, layers, norm, head)."""
  hf, ours = _TOP[0]
  out = [_entry(hf, "params", (), ours)]
  for i in range(cfg.num_decoder_layers):
    moe = i >= cfg.first_num_dense_layers
    stack, j = ("moe_layers", i - cfg.first_num_dense_layers) if moe else ("dense_layers", i)
    out += _layer_tensors(cfg, i, (stack, "layers", j), moe)
  for k in range(cfg.mtp_num_layers):
    idx, p = cfg.num_decoder_layers + k, f"model.layers.{cfg.num_decoder_layers + k}."
    out += [_entry(p + hf, "params", ("mtp", k), ours) for hf, ours in _MTP]
    out += _layer_tensors(cfg, idx, ("mtp", k, "layer"), cfg.num_experts > 0)
    # DeepSeek's checkpoints hold the MTP module's embedding and head as copies of the main model's.
    out += [_entry(p + "embed_tokens.weight", "params", (), "embed.embedding", role="copy"),
            _entry(p + "shared_head.head.weight", "params", (), "output_head.kernel", role="copy")]
  out += [_entry(hf, "params", (), ours) for hf, ours in _TOP[1:]]
  return out


def split_fused_experts(w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """transformers' in-memory fused expert layout ([E,2I,D] gate_up_proj, [E,D,I] down_proj) -> per-expert names."""
  out = dict(w)
  for name in [n for n in w if n.endswith("mlp.experts.gate_up_proj")]:
    p = name[: -len("gate_up_proj")]
    gu, down = out.pop(name), out.pop(p + "down_proj")
    inter = gu.shape[1] // 2
    for e in range(gu.shape[0]):
      out.update({f"{p}{e}.gate_proj.weight": gu[e, :inter], f"{p}{e}.up_proj.weight": gu[e, inter:],
                  f"{p}{e}.down_proj.weight": down[e]})
  return out


def _t(w: np.ndarray) -> np.ndarray:  # HF Linear [out,in] <-> our kernel [in,out]
  return np.ascontiguousarray(np.swapaxes(w, -1, -2))


def _nest(flat: dict[tuple, Any]) -> dict:
  out: dict = {}
  for path, v in flat.items():
    node = out
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = v
  return out


def _key(path) -> tuple:
  return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)


def flatten(tree) -> dict[tuple, np.ndarray]:
  return {_key(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


SCALE_INV = "_scale_inv"  # HF's name of a block-quantized weight's scales: <name>.weight_scale_inv
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def _scale_path(ours: tuple) -> tuple:
  return (*ours[:-1], ours[-1] + SCALE_SUFFIX)


def from_hf(w: dict[str, np.ndarray], cfg: Config) -> dict:
  """HF tensors -> {"params", "buffers"} in the unstacked layout, each tensor in its own dtype: an fp8
  weight stays fp8 (transposed to our [in, out]), its `weight_scale_inv` [ceil(out/b), ceil(in/b)]
  beside it at `<name>_scale` (transposed likewise); linears.requantized then fits the tree to the model."""
  w = split_fused_experts(w)
  flat: dict[tuple, Any] = {}
  for t in tensor_map(cfg):
    if t.role == "copy" or (t.role == "bias" and not cfg.routed_bias):
      continue
    if t.hf not in w:
      if t.role != "bias":
        raise ValueError(f"the HF checkpoint has no tensor {t.hf} (the config describes {cfg.num_decoder_layers} "
                         f"layers, {cfg.num_experts} experts, mtp_num_layers={cfg.mtp_num_layers})")
      flat[t.ours] = np.zeros((cfg.num_experts,), np.float32)
      continue
    parts = {t.ours: w[t.hf]}
    if w[t.hf].dtype == FP8:
      if t.hf + SCALE_INV not in w:
        raise ValueError(f"fp8 tensor {t.hf} has no {t.hf}{SCALE_INV}")
      parts[_scale_path(t.ours)] = w[t.hf + SCALE_INV]
    for path, a in parts.items():
      a = _t(a) if t.linear else a
      if t.expert is None:
        flat[path] = a
      else:
        flat.setdefault(path, [None] * cfg.num_experts)[t.expert] = a
  flat = {k: np.stack(v) if isinstance(v, list) else v for k, v in flat.items()}  # experts -> [E,...]
  tree = _nest(flat)
  tree.setdefault("buffers", {})
  return tree


def to_hf(tree: dict, cfg: Config, dtype=None):
  """{"params", "buffers"} in the unstacked layout -> (HF name, numpy array) pairs in HF order, one at a
  time (a caller may write and drop each). dtype: cast float weights to it; the routing bias stays fp32
  as in HF; an fp8 weight is written as it is, followed by its `weight_scale_inv` (fp32)."""
  flat = flatten(tree)
  for t in tensor_map(cfg):
    if t.role == "bias":  # the HF router always has one (zeros change nothing), always fp32
      a = flat[t.ours] if cfg.routed_bias else np.zeros((cfg.num_experts,), np.float32)
      yield t.hf, np.asarray(a, np.float32)
      continue
    row = (lambda a: a) if t.expert is None else (lambda a: a[t.expert])
    a = row(flat[t.ours])
    a = _t(a) if t.linear else np.ascontiguousarray(a)
    scale = flat.get(_scale_path(t.ours))
    if scale is not None:
      yield t.hf, np.asarray(a)
      yield t.hf + SCALE_INV, np.asarray(_t(row(scale)), np.float32)
      continue
    yield t.hf, a if dtype is None else a.astype(dtype)


def check_against(tree: dict, abstract: dict, what: str) -> dict:
  """`tree` has the structure and shapes of `abstract` (the model the config builds); cast to its dtypes."""
  flat_t, flat_a = flatten(tree), flatten(abstract)
  name = lambda k: "".join(f"[{p!r}]" for p in k)  # noqa: E731
  missing = sorted(name(k) for k in flat_a.keys() - flat_t.keys())
  extra = sorted(name(k) for k in flat_t.keys() - flat_a.keys())
  if missing or extra:
    raise ValueError(f"{what} does not match the configured model: missing {missing[:5]}, unexpected {extra[:5]}")
  for k, a in flat_a.items():
    if tuple(flat_t[k].shape) != tuple(a.shape):
      raise ValueError(f"{what} does not match the configured model: {name(k)} has shape {tuple(flat_t[k].shape)}, "
                       f"the model {tuple(a.shape)}")
  return jax.tree_util.tree_map_with_path(lambda p, a: np.asarray(flat_t[_key(p)], dtype=a.dtype), abstract)


# ---------------------------------------------------------------- scanned <-> unstacked layer stacks
_STACKS = ("dense_layers", "moe_layers")


def stack_layers(tree: dict) -> dict:
  """{stack: {"layers": {i: layer}}} -> {stack: {"layers": layer arrays stacked on axis 0}}, params and buffers."""
  def one(part):
    return {k: ({"layers": jax.tree.map(lambda *a: np.stack(a), *[v["layers"][i] for i in sorted(v["layers"])])}
                if k in _STACKS else v) for k, v in part.items()}
  return {name: one(part) for name, part in tree.items()}


def unstack_layers(tree: dict) -> dict:
  """The inverse of `stack_layers`; a tree already unstacked (integer layer keys) is returned as it is."""
  def one(part):
    out = {}
    for k, v in part.items():
      layers = v.get("layers") if k in _STACKS else None
      if layers is None or all(isinstance(i, int) for i in layers):
        out[k] = v
        continue
      n = jax.tree.leaves(layers)[0].shape[0]
      out[k] = {"layers": {i: jax.tree.map(lambda a, i=i: a[i], layers) for i in range(n)}}
    return out
  return {name: one(part) for name, part in tree.items()}


# ---------------------------------------------------------------- safetensors files
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
           "I64": np.int64, "I32": np.int32, "U8": np.uint8}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}
INDEX_FILE = "model.safetensors.index.json"


def read_safetensors(path: str) -> dict[str, np.ndarray]:
  """All tensors of one .safetensors file as numpy arrays (memory-mapped)."""
  with open(path, "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    header = json.loads(f.read(n))
  data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
  out = {}
  for name, meta in header.items():
    if name == "__metadata__":
      continue
    if meta["dtype"] not in _DTYPES:
      raise ValueError(f"{path}: tensor {name} has unsupported dtype {meta['dtype']}")
    a, b = meta["data_offsets"]
    out[name] = np.frombuffer(data[a:b], dtype=_DTYPES[meta["dtype"]]).reshape(meta["shape"])
  return out


def read_folder(path: str, what: str = "") -> dict[str, np.ndarray]:
  """Every tensor of every *.safetensors file in `path` (what: how error messages name the folder)."""
  files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
  if not files:
    raise FileNotFoundError(f"{what}{path}: no *.safetensors files")
  tensors = {}
  for f in files:
    tensors.update(read_safetensors(f))
  return tensors


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
  """One .safetensors file (header padded to 8 bytes, metadata format=pt as transformers expects)."""
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  for name, a in tensors.items():
    header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
    offset += a.nbytes
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw)
    for a in tensors.values():
      f.write(np.ascontiguousarray(a).tobytes())


def write_sharded(folder: str, tensors, max_shard_bytes: int) -> list[str]:
  """(name, array) pairs -> model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json
  when they exceed max_shard_bytes (a tensor larger than that gets a shard of its own). Holds one shard in
  memory at a time. Returns the file names."""
  shards: list[list[str]] = []
  pending: dict[str, np.ndarray] = {}
  size = total = 0

  def flush():
    write_safetensors(os.path.join(folder, f"model-{len(shards) + 1}.safetensors.part"), pending)
    shards.append(list(pending))
    pending.clear()

  for name, a in tensors:
    if pending and size + a.nbytes > max_shard_bytes:
      flush()
      size = 0
    pending[name] = a
    size += a.nbytes
    total += a.nbytes
  flush()
  n = len(shards)
  names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
  for i, f in enumerate(names):
    os.replace(os.path.join(folder, f"model-{i + 1}.safetensors.part"), os.path.join(folder, f))
  if n > 1:
    index = {"metadata": {"total_size": total}, "weight_map": {t: f for f, s in zip(names, shards) for t in s}}
    with open(os.path.join(folder, INDEX_FILE), "w") as f:
      json.dump(index, f, indent=2)
  return names
