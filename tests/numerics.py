"""Tolerances for comparing two float32 computations of the same quantity.

Two programs that compute the same value in a different order (sharded or not, another batch
shape, another kernel, another processor's vector width) differ by rounding. That difference is
relative to the magnitudes the reductions summed, not to each output element: a score of -2 can
come out of sums whose terms are as large as the largest score. So the tolerance is scaled by the
largest |value| the comparison holds, not applied element by element, and it grows with the
length of the longest float32 reduction (random-sign rounding errors add up as its square root).

`SAFETY` covers the worst element of many and errors compounding through a few layers; it was
checked under the XLA:CPU flags that change the reduction order and vector width with which
.ci/run reruns the `numerics` tests.
"""
import numpy as np

F32_EPS = float(np.finfo(np.float32).eps)
# tests/fixtures' Hugging Face checkpoints (hidden 32, MLP 64): their longest reduction.
FIXTURE_TERMS = 64
SAFETY = 16.0


def f32_atol(desired, terms: int, *, scale: float | None = None) -> float:
  """The absolute tolerance of a float32 result whose longest reduction sums `terms` values:
  SAFETY * eps * sqrt(terms) * the largest finite |desired| (or `scale`)."""
  if scale is None:
    d = np.abs(np.asarray(desired, np.float64))
    scale = float(np.max(d[np.isfinite(d)], initial=0.0))
  return SAFETY * F32_EPS * float(np.sqrt(terms)) * scale


def assert_f32_close(actual, desired, terms: int, *, scale: float | None = None, err_msg=''):
  """`actual` equals `desired` up to float32 rounding of `terms`-long reductions (NaNs where
  `desired` has them)."""
  np.testing.assert_allclose(actual, desired, rtol=0, atol=f32_atol(desired, terms, scale=scale),
                             err_msg=err_msg)
