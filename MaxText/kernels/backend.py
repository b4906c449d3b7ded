"""What the kernels run on each backend: the one place that picks per backend.

Every kernel that has more than one way to compute the same thing reads its choice here, when it
is traced. A backend's row in TABLE says what runs there. The "cpu" row is tuned and measured on
XLA:CPU (docs/measured_choices.md). The "tpu" row takes the binned selections (measured on a TPU
v5e) and the portable rest; every other backend ("gpu", any other) runs the portable
implementations: plain XLA ops that every backend lowers well. A backend's row changes only after a
measurement on it (tools/device/device_check.sh, docs/accelerators.md).

  choice             cpu (measured)                        portable (gpu, others; tpu: the
                                                           selections binned, as on the cpu)
  exact_selection    "binned": each row's k-th value from  "top_k": lax.top_k (its indices
                     strided bins closed by bisection      scattered into a mask, or sorted
                     (selection.py)                        as the gather path's slots); tpu: "pallas", the
                                                           k-th value by a Mosaic kernel over rows in VMEM
                                                           (kth_value.py; approx: "binned")
  approx_selection   "binned": the top m of strided bins   "approx_max_k": lax.approx_max_k
  row_blocks         "cache": rows in L2-sized blocks, a   "all": every row in one block
                     loop over blocks (selection_keys.py)
  query_loop         "loop": one query at a time inside a  "vmap": a block's queries batched
                     gather-path block (sparse_attention)
  grouped_matmul     "blocked": per-block matmuls of each  "ragged_dot": lax.ragged_dot
                     expert's padded rows (moe_experts)
  moe_exchange       "all_to_all": fixed capacity (XLA:CPU "ragged_all_to_all": rows sent =
                     lacks ragged_all_to_all; moe_dispatch) rows routed
  gather_min_length  3072: the mask/gather crossover at    3072: the CPU's figure, not measured
                     k=2048 (sparse_attention_impl=auto)   on these backends
  index_placement    "search": mask_to_indices' slots by   "search" (gpu, others); "compare": by counting
                     a binary search over prefix counts    (no while loop of gathers); tpu: "grouped",
                                                           counting in two levels (groups of 16 words, one-hot
                                                           rows: O(k (L/16 + 16)), not O(k L))
  mask_attention     "xla": MLA.attend's dense logits and  "xla" (gpu, others); tpu: "splash", JAX's
                     probabilities [b,h,t,s] in memory     Pallas splash kernel (kernels/flash_attention
                                                           .py) where the support is the validity mask
                                                           (MLA.use_flash; measured on a v5e: the
                                                           train step 173.6 vs 183.6 ms)
  paged_scoring      "xla": PagedKeys' loop of page blocks "xla" (gpu, others); tpu: "pallas", the
                     (inference/paged_cache.py)            Pallas kernel paged_decode.paged_index_scores
                                                           for one decode query a row (measured on a
                                                           v5e: 7.0 vs 98 ms at 16 rows of 128K fp8)
                                                           ("triton": paged_decode_gpu's kernel for a
                                                           GPU; no row takes it until measured there)
  rope_storage       "bits": a paged pool's bf16 k_pe as    "bits" (gpu, others); tpu: "rows", int32
                     uint16 [N, r] (paged_pools.py), the    words of 2, several slots a 128-word row
                     fp8 latent's scales f32 [N, 4]         (a v5e copied the [N, 64] uint16 pool whole
                                                           each step: 1.27 of 10.3 ms at 16 x 128K), and
                                                           the latent's scales 32 slots a row (as [L, N, 4]
                                                           relaid whole in the layer loop from 8 layers)
  fp8_unpack         "bitcast": adjacent codes a word,      "bitcast" (gpu, others); tpu: "shifts": codes
                     words viewed as bytes, then the       strided in their words, 4 shifts, each piece a
                     codes' [.., 4, 128] blocks            whole 128-block times its scale
  matmul_layout      "free": XLA lays out a matmul's        "free" (gpu, others); tpu: "few_rows_pinned", an
                     output as it likes                    output with fewer rows than its weight row-major
                                                           (else XLA relaid out the WEIGHT every decode step)
  page_lookup        "gather": each selected position's     "gather" (gpu, others); tpu: "onehot", a one-hot
                     page id through the page table by a    [B,m,P] x the ids' bytes [B,P,4] dot on the MXU
                     take_along_axis (paged_cache.py)       (v5e: a gather costs ~10 ns an index, 0.36 ms at
                                                           16 x 2048 selected; the dot 0.06-0.09 ms)
  key_order          "natural": a paged fp8 idx_k pool as   "natural" (gpu, others); tpu: "paired", int8 rows
                     uint8 rows in slot order               paired in 256-slot groups, subnormals flushed: the
                                                           scoring kernel's bf16 keys by 9 word ops per 4
                                                           codes, not ~15 per code (fp8_blocks.paired_rows)
  sparse_decode      "xla": a decode step's selected       "xla" (gpu, tpu, others); "triton": paged_decode_gpu's
                     latents gathered (gather_selected),   kernel reads them from the pools (paged_cache.
                     then gather_attend (attention_mla)    attend_selected; the new token merged by its lse);
                                                           no row takes it until measured on a GPU
  gather_attention   "xla": the gather path's attention    "xla" (gpu, tpu, others); "pallas": the Mosaic kernels
                     over each query's selected rows        of kernels/sparse_mla_kernel.py over rows gathered by
                     (sparse_attention._attend_block:       XLA; "pallas_dma": the kernels DMA each selected row
                     [b,h,t,k] logits in memory)            into VMEM themselves; no row takes either until timed
                                                           on a TPU (benchmarks/long_context.py --force)

Every choice keeps the selection invariants of DESIGN.md: both exact selections are lax.top_k's
set (ties lowest position first); both approximate ones reach their recall target.

To force choices (tests on the CPU, benchmarks comparing implementations on one device):

    with backend.forced("gpu"):                        # the row a GPU would take, here
      ...
    with backend.forced(exact_selection="binned"):     # one choice, the rest as the backend's row
      ...

A choice is read when a function is TRACED: a jitted function keeps what it traced, so the
`with` must enclose its first call (or a fresh jax.jit). Config keys that name a choice win over
the table: moe_exchange (other than auto), sparse_attention_gather_min_length (other than 0).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Choices:
  """One backend's row: which implementation each choice takes (see the module doc)."""
  exact_selection: str  # "binned" | "top_k" | "pallas"
  approx_selection: str  # "binned" | "approx_max_k"
  row_blocks: str  # "cache" | "all"
  query_loop: str  # "loop" | "vmap"
  grouped_matmul: str  # "blocked" | "ragged_dot"
  moe_exchange: str  # "all_to_all" | "ragged_all_to_all"
  gather_min_length: int  # key length from which sparse_attention_impl=auto takes the gather path
  paged_scoring: str = "xla"  # "xla" | "pallas" | "triton": the paged indexer scores of a decode step
  index_placement: str = "search"  # "search" | "compare" | "grouped": how topk_indices.mask_to_indices places its slots
  mask_attention: str = "xla"  # "xla" | "splash": MLA's mask path where its support is every valid key
  rope_storage: str = "bits"  # "bits" | "rows": how a paged pool holds the bf16 k_pe (paged_pools.init_layer_pools)
  page_lookup: str = "gather"  # "gather" | "onehot": the selected positions' page ids (paged_cache.lookup_pages)
  matmul_layout: str = "free"  # "free" | "few_rows_pinned": a few-row matmul output's layout (fp8_blocks.matmul)
  fp8_unpack: str = "bitcast"  # "bitcast" | "shifts": fp8 codes' order in 32-bit words, and their unpacking (to_words)
  key_order: str = "natural"  # "natural" | "paired": a paged fp8 idx_k pool's rows (paged_pools.paired_keys)
  sparse_decode: str = "xla"  # "xla" | "triton": a paged decode step's attention over its selected slots
  gather_attention: str = "xla"  # "xla" | "pallas" | "pallas_dma": the gather path's attention (sparse_attention.py)


OPTIONS = {  # the implementations of each string choice: CPU-tuned first, portable second
    "exact_selection": ("binned", "top_k"),
    "approx_selection": ("binned", "approx_max_k"),
    "row_blocks": ("cache", "all"),
    "query_loop": ("loop", "vmap"),
    "grouped_matmul": ("blocked", "ragged_dot"),
    "moe_exchange": ("all_to_all", "ragged_all_to_all"),
}
KERNELS = {  # choices whose first way the cpu and portable rows take, the second measured on a TPU (its row)
    "paged_scoring": ("xla", "pallas"),  # the XLA path, a Pallas kernel (kernels/paged_decode.py)
    "index_placement": ("search", "compare"),  # topk_indices.mask_to_indices: a binary search, counting
    "mask_attention": ("xla", "splash"),  # MLA.attend's [b,h,t,s] tensors, kernels/flash_attention.py
    "rope_storage": ("bits", "rows"),  # paged_pools: uint16 [N, r]; int32 pairs, 128-word rows of several slots
    "page_lookup": ("gather", "onehot"),  # paged_cache.lookup_pages: take_along_axis; a one-hot dot
    "matmul_layout": ("free", "few_rows_pinned"),  # fp8_blocks.matmul: XLA's choice; row-major below K rows
    "fp8_unpack": ("bitcast", "shifts"),  # from_words / dequantize_fp8: a bitcast view; shifts, a block a piece
    "key_order": ("natural", "paired"),  # paged_pools: an fp8 idx_k pool's rows in slot order; int8, paired
    "sparse_decode": ("xla",),  # the selected latents gathered, then gather_attend (the Mosaic kernel tied it: none)
    "gather_attention": ("xla",),  # sparse_attention._attend_block's XLA attention (the kernels: MOSAIC_WAYS)
}
TPU_WAYS = {  # ways only the tpu row takes (beyond OPTIONS' cpu and portable ones), measured there
    "exact_selection": ("pallas",),  # the k-th value by a Mosaic kernel over rows in VMEM (kth_value.py)
    "index_placement": ("grouped",),  # mask_to_indices' slots by counting in two levels (topk_indices.py)
}
MOSAIC_WAYS = {  # ways written for a TPU (Mosaic); no row takes them until timed on one (forced meanwhile)
    "gather_attention": ("pallas", "pallas_dma"),  # kernels/sparse_mla_kernel.py: rows gathered by XLA; by DMAs
}
GPU_WAYS = {  # ways written for a GPU (Triton); no row takes them until measured on one (forced meanwhile)
    "paged_scoring": ("triton",),  # paged_decode_gpu.paged_index_scores: gathered loads of a block's keys
    "sparse_decode": ("triton",),  # paged_cache.attend_selected: paged_decode_gpu.sparse_mla_decode on the pools
}

# paged_scoring "xla" on the CPU: PagedKeys' page-block loop, one row and one L2-sized block at a time (XLA:CPU runs
# each block's dot on one YNNPACK thread; 4 rows' blocks in one iteration, a batched dot, wider blocks or YNNPACK off
# measured no faster), fp8 keys scored as their codes with each key's scale applied to its score (4 rows x 128K: 134.7
# vs 134.7 ms CPU against dequantizing each block first (decode_fp8.py, in git history), 148.8 vs 163.5, 141.3 vs 146.0
# and 130.6 vs 134.2 in ad hoc runs: no slower, 0-9% less; docs/kernels.md, On the CPU).
CPU = Choices(exact_selection="binned", approx_selection="binned", row_blocks="cache", query_loop="loop",
              grouped_matmul="blocked", moe_exchange="all_to_all", gather_min_length=3072)
PORTABLE = Choices(exact_selection="top_k", approx_selection="approx_max_k", row_blocks="all", query_loop="vmap",
                   grouped_matmul="ragged_dot", moe_exchange="ragged_all_to_all", gather_min_length=3072)

# TPU v5e (docs/accelerators.md, Figures): on f32[1,1024,131072], k=2048, the binned selections take 18.3 ms
# (exact) and 16.8 ms (approx, recall 0.97) against lax.top_k's 215 ms and lax.approx_max_k's 95 ms; the rest
# stays portable (not measured there).
# The paged decode scoring through the Pallas kernel: 1.14 / 2.39 / 7.03 ms at 1 / 4 / 16 rows of 128K fp8 keys
# against the XLA page-block loop's 1.15 / 7.84 / 98.4 ms (benchmarks/paged_decode_kernels.py, docs/kernels.md).
# Its arithmetic reworked (fp8 decode, 3 bf16 passes, the head sum on the VPU): 5.58 -> 2.98 ms of device time in
# the 16-row 128K step (benchmarks/decode_profile.py, docs/kernels.md).
# mask_to_indices' slots placed by counting (index_placement "compare"): the binary search is a while loop of
# 1-D gathers there (8.5 of a 26 ms 16-row 128K decode step, benchmarks/decode_profile.py, docs/kernels.md).
# MLA's mask path in splash where its support is every valid key (mask_attention "splash"): the v5e train step of
# configs/models/deepseek3.2-v5e.yml at 1 x 2048 tokens 173.6 vs 183.6 ms, 10.31 vs 13.44 GiB, so 2 x 2048 fits
# (11.46 GiB: model MFU 37.1%); with the KL target in its kernel (kernels/kl_target.py, the same choice) 146.0 ms
# (41.0%) and 2 x 2048 267.1 ms (44.8%) (benchmarks/tpu_decode_check.sh mfu, docs/accelerators.md, 2026-12-06).
# The bf16 k_pe pool as int32 words in 128-word rows (rope_storage "rows"): as uint16 [N, 64] XLA laid it out
# column-major and copied all of it (1.27 ms) for each 16-row 128K step's row gather (docs/kernels.md).
# The selected positions' page ids by a one-hot dot (page_lookup "onehot"): a [16, 2048] take_along_axis from the
# [16, P] table 0.363 ms, the dot 0.086 (P 2048) / 0.058 ms (P 512) (a probe in git history: scoring_pages.py).
# A few-row matmul's output pinned row-major (matmul_layout "few_rows_pinned"): the 16-row 128K step's profile on the
# v5e showed wq_b's weight relaid out every step (copy bf16[1,1536,24576], 0.335 ms); compiled for the v5e with the
# pin, that copy and the indexer's wq_b one (25 MB) are gone (decode_profile --compile-for, docs/kernels.md). On the
# CPU the pin cost the 4-row 128K fp8 sparse step ~8 ms (97 vs 89 ms, decode.py, trees side by side): not there.
# fp8 codes strided in their words, unpacked by shifts a 128-block a piece (fp8_unpack "shifts"): compiled for the
# v5e, the bitcast view's u32[16,2048,128,4] and the scales' f32[16,2048,4,128] (67 MB each) are gone; on the CPU
# the strided order cost the 4-row 128K step's gather + merge 8.0 ms (shifts) or 22.6 ms (a bitcast view and a
# transpose) against 2.3 (its profile), so the CPU keeps adjacent codes and the view.
# The k-th value by its Mosaic kernel (exact_selection "pallas") and the slots placed in two levels (index_placement
# "grouped"): the 16-row 128K fp8 step (page 256) on a v5e, 2026-12-06 21:45 UTC, one process each, this tree:
# 4.778 / 4.810 ms with "binned" + "compare", 4.550 with "grouped", 4.432 / 4.422 with both; 4 rows 2.411 -> 2.367,
# 1 row 2.113 -> 2.098 (benchmarks/decode_profile.py --force; the tree before the session's changes: 5.472 ms).
# A paged fp8 idx_k in paired order (key_order "paired"): its scoring kernel makes bf16 keys by 9 word ops per 4 codes,
# not ~15 per code (the kernel's compiled body 481 vs 1154 bundles a 2048-key grid step, VPU-bound): on a v5e,
# 2026-12-06 ~23:00 UTC, one process each, bf16 weights, page 256: the 16-row 128K fp8 step 4.338 -> 3.825 ms (the
# kernel 1.082 -> 0.651 ms), 3.594 at 8192 keys a grid step; 4 rows 2.207 -> 2.009, 1 row 1.903 -> 1.741.
TPU = dataclasses.replace(PORTABLE, exact_selection="pallas", approx_selection="binned", paged_scoring="pallas",
                          index_placement="grouped", rope_storage="rows", mask_attention="splash", page_lookup="onehot",
                          matmul_layout="few_rows_pinned", fp8_unpack="shifts", key_order="paired")

TABLE = {  # jax.default_backend() -> its row; a backend not listed runs PORTABLE
    "cpu": CPU,  # measured: docs/measured_choices.md
    "gpu": PORTABLE,  # not measured yet (docs/accelerators.md)
    "tpu": TPU,  # the selections measured (above)
}

_FORCED: contextvars.ContextVar[tuple[str | None, dict]] = contextvars.ContextVar("kernel_choices",
                                                                                  default=(None, {}))


def row(backend: str) -> Choices:
  """TABLE's row for a backend name ("cpu", "gpu", "tpu", ...), PORTABLE where it has none."""
  return TABLE.get(backend, PORTABLE)


def choices() -> Choices:
  """The choices in force: the row of this process's backend (or of `forced`'s backend), with
  `forced`'s overrides."""
  backend, overrides = _FORCED.get()
  return dataclasses.replace(row(backend or jax.default_backend()), **overrides)


def choice(name: str):
  """One choice in force, e.g. choice("grouped_matmul") -> "blocked" on the CPU."""
  return getattr(choices(), name)


def pallas_interpret(interpret: bool | None, platform: str = "tpu") -> bool:
  """A Pallas kernel's `interpret` argument: None -> Pallas' interpreter wherever the backend the kernels are
  traced for (`forced`'s, else this process's) is not the kernel's `platform` ("tpu": Mosaic's lowering; "gpu":
  Triton's, kernels/paged_decode_gpu.py); a bool as given. Every kernel module asks here. forced("tpu") on a host
  without one: Mosaic's lowering, for a compile-only TPU target (decode_profile --compile-for)."""
  if interpret is not None:
    return interpret
  return (_FORCED.get()[0] or jax.default_backend()) != platform


MOSAIC_LANES = 128  # a Mosaic block's last dimension: a multiple of 128 lanes (its second-last: of 8 sublanes) ...
# ... unless the block spans that dimension of the array whole (Pallas' TPU lowering refuses any other block)


def dot_precision(dtype) -> jax.lax.Precision:
  """The precision a dot inside a Mosaic kernel (or a TPU lowering to one: ragged_dot's grouped matmul) names for
  operands of `dtype`: HIGHEST for fp32, DEFAULT (one MXU pass: exact for bf16- and fp8-valued operands) otherwise.
  Never the process default: under JAX_DEFAULT_MATMUL_PRECISION=highest a bf16 dot becomes an fp32-contract one,
  which Mosaic refuses ("Bad lhs type")."""
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def mosaic_block(n: int, want: int) -> tuple[int, int]:
  """(block, padded length) for a Pallas TPU kernel's blocks along an axis of length n that is a block's last
  dimension (MOSAIC_LANES, which also meets the second-last's 8): `want` where it is a multiple of 128 lanes,
  else the smallest multiple of `want` that is (so a block is still whole units of `want`: pages, slots), or
  the whole axis as one block where that block would be no shorter. The axis is padded to whole blocks (the
  kernel masks the padding). Every Mosaic kernel of the decode step asks here: a shape it cannot tile is
  padded, never refused."""
  if want % MOSAIC_LANES:
    want *= MOSAIC_LANES // math.gcd(want, MOSAIC_LANES)
    if want >= n:
      return n, n
  return want, -(-n // want) * want


def _check(backend: str | None, overrides: dict) -> None:
  fields = {f.name for f in dataclasses.fields(Choices)}
  for name, value in overrides.items():
    if name not in fields:
      raise ValueError(f"backend.forced: no choice {name!r}; the choices are {sorted(fields)}")
    if name == "gather_min_length":
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"backend.forced: gather_min_length must be an int >= 1, got {value!r}")
    elif value not in (ways := {**OPTIONS, **KERNELS}[name] + TPU_WAYS.get(name, ()) + MOSAIC_WAYS.get(name, ())
                                 + GPU_WAYS.get(name, ())):
      raise ValueError(f"backend.forced: {name}={value!r}; expected one of {ways}")
  if backend is not None and not isinstance(backend, str):
    raise ValueError(f"backend.forced: backend must be a name such as 'gpu', got {backend!r}")


def parse_forced(pairs) -> dict:
  """A command line's NAME=VALUE pairs (e.g. ["index_placement=grouped"]) -> forced's overrides, checked: a pair
  without "=", a name that is no choice or a value it does not take raises ValueError with one line."""
  out = {}
  for pair in pairs:
    name, eq, value = pair.partition("=")
    if not eq:
      raise ValueError(f"backend.forced: expected NAME=VALUE (a kernels/backend.py choice), got {pair!r}")
    out[name] = int(value) if name == "gather_min_length" and value.lstrip("-").isdigit() else value
  _check(None, out)
  return out


@contextlib.contextmanager
def forced(backend: str | None = None, **overrides):
  """Within the block, kernels traced take `backend`'s row (default: this process's backend)
  with `overrides` on top; nested blocks add to the outer one. Yields the choices in force."""
  _check(backend, overrides)
  outer_backend, outer = _FORCED.get()
  token = _FORCED.set((backend or outer_backend, {**outer, **overrides}))
  try:
    yield choices()
  finally:
    _FORCED.reset(token)
