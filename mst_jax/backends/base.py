"""The interface every per-chunk cross-entropy backend implements."""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
from jax import lax

from mst_jax import ce_math


class ChunkCE(Protocol):
  """Blockwise cross-entropy on one chunk of logits.

  Logits come in float32 (float64) or in the compute dtype (bfloat16);
  implementations compute in at least float32 and return float32 statistics.

  Implementations are frozen dataclasses (hashable: they travel as static
  configuration through ``jax.jit`` and ``jax.custom_vjp``).
  """

  name: str

  def forward(
    self, logits: jax.Array, labels: jax.Array, options: ce_math.CEOptions
  ) -> ce_math.RowStats:
    """Reduces ``logits`` (``[rows, V]``) and ``labels`` (int32 ``[rows]``)."""
    ...

  def backward(
    self,
    logits: jax.Array,
    labels: jax.Array,
    rows: ce_math.BackwardRows,
    options: ce_math.CEOptions,
    out_dtype: jax.typing.DTypeLike,
    vocab_size: int | None = None,
  ) -> jax.Array:
    """Returns ``dloss/dlogits`` (``[rows, V]`` in ``out_dtype``).

    ``vocab_size`` is the whole vocabulary when ``logits`` hold one shard of
    it (label smoothing spreads ``eps / V`` over all of it); default: the width
    of ``logits``.
    """
    ...

  def forward_backward(
    self,
    logits: jax.Array,
    labels: jax.Array,
    valid: jax.Array,
    g_loss: jax.Array,
    options: ce_math.CEOptions,
    out_dtype: jax.typing.DTypeLike,
    *,
    into: tuple[jax.Array, jax.Array] | None = None,
  ) -> tuple[ce_math.RowStats, jax.Array]:
    """``forward`` and ``backward`` in one sweep, for a known loss cotangent.

    ``g_loss`` (float32 ``[rows]``) is the cotangent of each row's loss; the lse
    cotangent is taken as zero. Returns the row statistics and ``dlogits``;
    with ``into=(buffer, row_offset)``, ``dlogits`` is written into rows
    ``row_offset:row_offset + rows`` of ``buffer`` (in place where the backend
    can) and the updated buffer is returned instead.
    """
    ...


def unfused_forward_backward(
  backend,
  logits,
  labels,
  valid,
  g_loss,
  options,
  out_dtype,
  into=None,
  vocab_size=None,
):
  """``forward_backward`` as a ``forward`` then a ``backward``.

  ``vocab_size``: the whole vocabulary when ``logits`` are one shard of it.
  """
  vocab_size = vocab_size or logits.shape[-1]
  stats = backend.forward(logits, labels, options)
  rows = ce_math.backward_rows(
    g_loss, jnp.zeros_like(stats.lse), stats.lse, labels, valid, options, vocab_size
  )
  dlogits = backend.backward(logits, labels, rows, options, out_dtype, vocab_size)
  if into is not None:  # XLA fuses the elementwise dlogits into this, in place
    buffer, offset = into
    dlogits = lax.dynamic_update_slice_in_dim(buffer, dlogits, offset, 0)
  return stats, dlogits
