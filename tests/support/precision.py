"""Tolerances that follow the backend's matmul precision: a test states its bound for exact f32 products
(the CPU's, a GPU's at JAX's default) and gets what the backend it runs on keeps."""

import jax

TPU_F32_RTOL = 1e-2  # a TPU multiplies f32 at JAX's default precision in one bf16 pass (8 mantissa bits, 2**-8 a
# product): 3.4e-3 - 4.5e-3 of the largest value measured on a v5e (test_moe's experts and gradients, the
# kernels' scores), so 1e-2 there; a planted bug moves results by O(1)


def f32_rtol(rtol: float) -> float:
  """`rtol` where f32 products are exact to f32 rounding; on a TPU at least TPU_F32_RTOL."""
  return max(rtol, TPU_F32_RTOL) if jax.default_backend() == "tpu" else rtol
