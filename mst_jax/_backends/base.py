"""The interface every per-chunk backend implements, and the columns it sees.

A loop order hands a backend one chunk of rows (``hidden [rows, D]``) and the
weight's columns it should score; the backend forms their logits and reduces
or differentiates the cross-entropy (``ChunkBackend``). A backend built from a
GEMM plus a cross-entropy on its output (the XLA and Pallas Triton ones)
implements only the logits part (``LogitsCE``) and inherits the rest from
``MatmulThenCE``; a kernel that fuses the GEMM with the cross-entropy
implements ``ChunkBackend`` directly.

When the weight holds only some of the vocabulary's columns (a vocab-parallel
shard), the statistics of those columns must be combined across devices
before ``dlogits`` can be formed; ``Columns`` says so, and
``chunk_forward_backward`` then splits its work around the combine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp
from jax import lax

from mst_jax import _ce_math, _matmul
from mst_jax._ce_math import BackwardRows, CEOptions, RowStats


@dataclasses.dataclass(frozen=True)
class HeadSpec:
  """How a chunk's logits are formed and scored (static, hashable).

  Attributes:
    weight_layout: ``"vd"`` or ``"dv"``.
    logits_dtype: the dtype the logits matmul writes.
    options: the per-row loss options.
    vocab_size: the whole vocabulary ``V`` (label smoothing spreads ``eps / V``
      over all of it, also when a weight holds only some columns).
  """

  weight_layout: str
  logits_dtype: jnp.dtype
  options: CEOptions
  vocab_size: int


class Columns(Protocol):
  """Which of the vocabulary's columns this device's weight holds."""

  split: bool  # False: all of them

  def offset(self) -> int | jax.Array:
    """The first column this device holds (a Python 0 when not split)."""
    ...

  def combine(self, stats: RowStats, labels: jax.Array) -> RowStats:
    """Whole-row statistics from this device's (``labels`` global)."""
    ...


@dataclasses.dataclass(frozen=True)
class AllColumns:
  """``Columns`` of a weight that holds the whole vocabulary."""

  split = False

  def offset(self) -> int:
    return 0

  def combine(self, stats: RowStats, labels: jax.Array) -> RowStats:
    del labels
    return stats


def relative_labels(labels: jax.Array, offset: int | jax.Array) -> jax.Array:
  """``labels`` as column indices of logits whose first column is ``offset``."""
  if isinstance(offset, int) and offset == 0:
    return labels
  return labels - offset


class ChunkBackend(Protocol):
  """A chunk's logits matmul and its cross-entropy.

  ``labels`` are global (int32 ``[rows]``); ``offset`` is the vocabulary index
  of the weight's first column (a block of it, or a shard). Implementations
  are frozen dataclasses (hashable: they travel as static configuration
  through ``jax.jit`` and ``jax.custom_vjp``), compute in at least float32 and
  return float32 statistics.
  """

  def chunk_forward(
    self, hidden, weight, bias, labels, head: HeadSpec, *, offset=0
  ) -> RowStats:
    """The ``RowStats`` of the weight's columns (relative to ``offset``)."""
    ...

  def chunk_backward(
    self,
    hidden,
    weight,
    bias,
    labels,
    rows: BackwardRows,
    head: HeadSpec,
    out_dtype,
    *,
    offset=0,
  ) -> jax.Array:
    """``dloss/dlogits`` of the weight's columns (``[rows, columns]``)."""
    ...

  def chunk_forward_backward(
    self,
    hidden,
    weight,
    bias,
    labels,
    valid,
    g_loss,
    head: HeadSpec,
    out_dtype,
    *,
    columns: Columns = AllColumns(),
    into=None,
  ) -> tuple[RowStats, jax.Array]:
    """Whole-row ``RowStats`` and ``dlogits`` in one sweep, for a known loss cotangent.

    ``g_loss`` (float32 ``[rows]``) is the cotangent of each row's loss; the
    lse cotangent is taken as zero. With ``into=(buffer, row_offset)``,
    ``dlogits`` is written into rows ``row_offset:row_offset + rows`` of
    ``buffer`` (in place where the backend can) and the buffer is returned
    instead.
    """
    ...


class LogitsCE(Protocol):
  """Blockwise cross-entropy of given logits ``[rows, V]`` (float32 or bfloat16)."""

  def forward(self, logits, labels, options: CEOptions) -> RowStats:
    """Reduces ``logits`` with ``labels`` relative to their first column."""
    ...

  def backward(
    self,
    logits,
    labels,
    rows: BackwardRows,
    options: CEOptions,
    out_dtype,
    vocab_size: int | None = None,
  ) -> jax.Array:
    """``dloss/dlogits`` in ``out_dtype``; ``vocab_size`` default: the width."""
    ...

  def forward_backward(
    self, logits, labels, valid, g_loss, options: CEOptions, out_dtype, *, into=None
  ) -> tuple[RowStats, jax.Array]:
    """``forward`` and ``backward`` of whole rows in one sweep."""
    ...


class MatmulThenCE:
  """``ChunkBackend`` as XLA's logits GEMM followed by a ``LogitsCE``.

  Mixed into a ``LogitsCE`` (whose ``forward``, ``backward`` and
  ``forward_backward`` it calls on the GEMM's output).
  """

  def _logits(self, hidden, weight, bias, head: HeadSpec) -> jax.Array:
    return _matmul.logits_matmul(
      hidden, weight, bias, head.weight_layout, head.logits_dtype
    )

  def chunk_forward(self, hidden, weight, bias, labels, head, *, offset=0):
    logits = self._logits(hidden, weight, bias, head)
    return self.forward(logits, relative_labels(labels, offset), head.options)

  def chunk_backward(
    self, hidden, weight, bias, labels, rows, head, out_dtype, *, offset=0
  ):
    logits = self._logits(hidden, weight, bias, head)
    labels = relative_labels(labels, offset)
    return self.backward(logits, labels, rows, head.options, out_dtype, head.vocab_size)

  def chunk_forward_backward(
    self,
    hidden,
    weight,
    bias,
    labels,
    valid,
    g_loss,
    head,
    out_dtype,
    *,
    columns=AllColumns(),
    into=None,
  ):
    logits = self._logits(hidden, weight, bias, head)
    if not columns.split:
      return self.forward_backward(
        logits, labels, valid, g_loss, head.options, out_dtype, into=into
      )
    local = relative_labels(labels, columns.offset())
    return unfused_forward_backward(
      self,
      logits,
      labels,
      valid,
      g_loss,
      head.options,
      out_dtype,
      into,
      vocab_size=head.vocab_size,
      stats=lambda: columns.combine(self.forward(logits, local, head.options), labels),
      local_labels=local,
    )


def unfused_forward_backward(
  backend: LogitsCE,
  logits: jax.Array,
  labels: jax.Array,
  valid: jax.Array,
  g_loss: jax.Array,
  options: CEOptions,
  out_dtype,
  into=None,
  *,
  vocab_size: int | None = None,
  stats: Callable[[], RowStats] | None = None,
  local_labels: jax.Array | None = None,
) -> tuple[RowStats, jax.Array]:
  """``forward_backward`` as a ``forward`` then a ``backward``.

  ``stats`` (default: ``backend.forward`` of the logits) gives the whole-row
  statistics, e.g. combined across vocabulary shards; ``local_labels`` are
  the labels relative to the logits' first column (default: ``labels``).
  """
  vocab_size = vocab_size or logits.shape[-1]
  local_labels = labels if local_labels is None else local_labels
  stats = stats() if stats else backend.forward(logits, labels, options)
  rows = _ce_math.backward_rows(
    g_loss, jnp.zeros_like(stats.lse), stats.lse, labels, valid, options, vocab_size
  )
  dlogits = backend.backward(logits, local_labels, rows, options, out_dtype, vocab_size)
  if into is not None:  # XLA fuses the elementwise dlogits into this, in place
    buffer, offset = into
    dlogits = lax.dynamic_update_slice_in_dim(buffer, dlogits, offset, 0)
  return stats, dlogits
