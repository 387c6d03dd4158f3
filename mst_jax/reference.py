"""The full-logits reference: what every fast path computes, plainly.

``linear_cross_entropy`` here is ``mst_jax.linear_cross_entropy`` with
``impl="reference"``: it forms the whole ``[N, V]`` logits and differentiates
by autodiff. It is the test oracle (run on float64 inputs) and the
documentation of the semantics; ``losses_from_logits`` is its per-row math.
"""

from __future__ import annotations

from mst_jax._api import linear_cross_entropy as _chunked_or_reference
from mst_jax._full_logits import losses_from_logits, row_losses

__all__ = ["linear_cross_entropy", "losses_from_logits", "row_losses"]


def linear_cross_entropy(hidden, weight, labels, bias=None, **kwargs):
  """``mst_jax.linear_cross_entropy`` computed from the full logits.

  Takes the arguments of ``mst_jax.linear_cross_entropy`` except its
  performance options (``mst_jax.PerfOptions``: chunking, backend, dtypes,
  gradient mode) and the mesh, which do not apply, and returns the same
  values. Memory is ``O(N x V)``: for tests and small problems.
  """
  return _chunked_or_reference(hidden, weight, labels, bias, impl="reference", **kwargs)
