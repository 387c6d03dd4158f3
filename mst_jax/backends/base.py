"""The interface every per-chunk cross-entropy backend implements."""

from __future__ import annotations

from typing import Protocol

import jax

from mst_jax import ce_math


class ChunkCE(Protocol):
  """Blockwise cross-entropy on one chunk of float32 logits.

  Implementations are frozen dataclasses (hashable: they travel as static
  configuration through ``jax.jit`` and ``jax.custom_vjp``).
  """

  name: str

  def forward(
    self, logits: jax.Array, labels: jax.Array, options: ce_math.CEOptions
  ) -> ce_math.RowStats:
    """Reduces ``logits`` (float32 ``[rows, V]``) and ``labels`` (int32 ``[rows]``)."""
    ...

  def backward(
    self,
    logits: jax.Array,
    labels: jax.Array,
    rows: ce_math.BackwardRows,
    options: ce_math.CEOptions,
    out_dtype: jax.typing.DTypeLike,
  ) -> jax.Array:
    """Returns ``dloss/dlogits`` (``[rows, V]`` in ``out_dtype``)."""
    ...
