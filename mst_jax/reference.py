"""The full-logits reference: what every fast path computes, plainly.

``linear_cross_entropy``, ``linear_log_probs`` and ``linear_distillation_loss``
here are the ``mst_jax`` functions with ``impl="reference"``: they form the
whole ``[N, V]`` logits (both heads' for the distillation loss)
and differentiate by autodiff. They are the test oracle (run on float64
inputs) and the documentation of the semantics; ``losses_from_logits`` is
their per-row math.
"""

from __future__ import annotations

from mst_jax._losses import cross_entropy as _cross_entropy
from mst_jax._losses import distillation as _distillation
from mst_jax._losses import log_probs as _log_probs
from mst_jax._math.full_logits import losses_from_logits, row_losses

__all__ = [
  "linear_cross_entropy",
  "linear_distillation_loss",
  "linear_log_probs",
  "losses_from_logits",
  "row_losses",
]


def linear_cross_entropy(hidden, weight, labels, bias=None, **kwargs):
  """``mst_jax.linear_cross_entropy`` computed from the full logits.

  Takes the arguments of ``mst_jax.linear_cross_entropy`` except its
  performance options (``mst_jax.PerfOptions``: chunking, backend, dtypes,
  gradient mode) and the mesh, which do not apply, and returns the same
  values. Memory is ``O(N x V)``: for tests and small problems.
  """
  return _cross_entropy.linear_cross_entropy(
    hidden, weight, labels, bias, impl="reference", **kwargs
  )


def linear_log_probs(hidden, weight, labels, bias=None, **kwargs):
  """``mst_jax.linear_log_probs`` computed from the full logits (likewise)."""
  return _log_probs.linear_log_probs(
    hidden, weight, labels, bias, impl="reference", **kwargs
  )


def linear_distillation_loss(
  student_hidden, student_weight, teacher_hidden, teacher_weight, labels=None, **kwargs
):
  """``mst_jax.linear_distillation_loss`` from both heads' full logits,
  differentiated by autodiff (likewise; ``_math.full_distill`` has the math)."""
  return _distillation.linear_distillation_loss(
    student_hidden,
    student_weight,
    teacher_hidden,
    teacher_weight,
    labels,
    impl="reference",
    **kwargs,
  )
