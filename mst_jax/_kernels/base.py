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
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax import lax

from mst_jax._gemm import matmul
from mst_jax._math import ce as ce_math
from mst_jax._math.ce import BackwardRows, CEOptions, ClassRows, RowStats


@dataclasses.dataclass(frozen=True)
class HeadSpec:
  """How a chunk's logits are formed and scored (static, hashable).

  Attributes:
    weight_layout: ``"vd"`` or ``"dv"``.
    logits_dtype: the dtype the logits matmul writes.
    options: the per-row loss options.
    vocab_size: the whole vocabulary ``V`` (label smoothing spreads ``eps / V``
      over all of it, also when a weight holds only some columns).
    matmul_tile: None, or the vocabulary columns each matmul takes at a time
      (``_gemm.matmul``: for XLA:CPU, which converts 16-bit operands whole).
    gemm: what runs the matmuls, ``"xla"`` or ``"mosaic"`` (``_gemm.matmul``).
  """

  weight_layout: str
  logits_dtype: jnp.dtype
  options: CEOptions
  vocab_size: int
  matmul_tile: int | None = None
  gemm: str = "xla"


class Columns(Protocol):
  """Which of the vocabulary's columns this device's weight holds."""

  split: bool  # False: all of them

  def offset(self) -> int | jax.Array:
    """The first column this device holds (a Python 0 when not split)."""
    ...

  def combine(self, stats: RowStats, labels: jax.Array) -> RowStats:
    """Whole-row statistics from this device's (``labels`` global)."""
    ...

  def sum_partial(self, x: jax.Array) -> jax.Array:
    """``x``, formed from this device's columns, summed over all columns."""
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

  def sum_partial(self, x: jax.Array) -> jax.Array:
    return x


def relative_labels(labels: jax.Array, offset: int | jax.Array) -> jax.Array:
  """``labels`` as column indices of logits whose first column is ``offset``."""
  if isinstance(offset, int) and offset == 0:
    return labels
  return labels - offset


class ChunkInputs(NamedTuple):
  """One chunk's rows and the weight columns to score them against.

  Attributes:
    hidden: ``[rows, D]``.
    weight: ``[columns, D]`` or ``[D, columns]`` (``HeadSpec.weight_layout``):
      the whole vocabulary, a block of it, or a shard.
    bias: ``[columns]`` or None.
    labels: int32 ``[rows]``, indices into the whole vocabulary.
    class_weights: ``[columns]`` class weights (with label smoothing), or None.
    classes: the rows' class-weight factors, or None (no class weights).
    bound: None, or an int32 scalar: no row from it on counts (all excluded),
      and a backend may leave their logits, statistics and ``dlogits``
      unspecified (``_gemm.matmul``'s products leave them out).
  """

  hidden: jax.Array
  weight: jax.Array
  bias: jax.Array | None
  labels: jax.Array
  class_weights: jax.Array | None = None
  classes: ClassRows | None = None
  bound: jax.Array | None = None


class ChunkBackend(Protocol):
  """A chunk's logits matmul and its cross-entropy.

  ``offset`` is the vocabulary index of the weight's first column (of a block
  or a shard). Implementations are frozen dataclasses (hashable: they travel
  as static configuration through ``jax.jit`` and ``jax.custom_vjp``), compute
  in at least float32 and return float32 statistics.
  """

  def chunk_logits(self, x: ChunkInputs, head: HeadSpec) -> jax.Array:
    """The chunk's logits ``[rows, columns]`` in ``head.logits_dtype``."""
    ...

  def logits_and_stats(
    self, x: ChunkInputs, head: HeadSpec, offset
  ) -> tuple[jax.Array, RowStats | None]:
    """``chunk_logits``, and the ``RowStats`` of these columns (labels
    relative to ``offset``) where the logits GEMM forms them too, else None."""
    ...

  def chunk_forward(
    self, x: ChunkInputs, head: HeadSpec, *, offset=0, logits=None
  ) -> RowStats:
    """The ``RowStats`` of the weight's columns (relative to ``offset``), of
    ``logits`` (from ``chunk_logits``) when given, else formed here."""
    ...

  def chunk_backward(
    self,
    x: ChunkInputs,
    rows: BackwardRows,
    head: HeadSpec,
    out_dtype,
    *,
    offset=0,
    logits=None,
  ) -> jax.Array:
    """``dloss/dlogits`` of the weight's columns (``[rows, columns]``), over
    ``logits`` when given (in place where the backend can), else recomputed."""
    ...

  def chunk_forward_backward(
    self, x: ChunkInputs, g_loss, head: HeadSpec, out_dtype, *, valid, columns, into
  ) -> tuple[RowStats, jax.Array]:
    """Whole-row ``RowStats`` and ``dlogits`` in one sweep, for a known loss cotangent.

    ``g_loss`` (float32 ``[rows]``) is the cotangent of each row's loss, the
    lse's is zero; ``valid`` (bool ``[rows]``) marks the rows that count.
    ``columns`` says which of the vocabulary's columns the weight holds. With
    ``into=(buffer, row_offset)``, ``dlogits`` is written into rows
    ``row_offset:row_offset + rows`` of ``buffer`` (in place where the backend
    can) and the buffer is returned instead; ``row_offset`` (traced) is a
    multiple of ``rows``.
    """
    ...

  def dlogits_width(self, x: ChunkInputs, head: HeadSpec) -> int:
    """The width of the ``dlogits`` the chunk methods return (and of a
    buffer ``into`` that they write): the weight's columns, or more where
    the backend pads the logits past them (``dlogits`` zero there). ``x``'s
    arrays may be ``jax.ShapeDtypeStruct``s."""
    ...

  def transposes_weight(self, x: ChunkInputs, head: HeadSpec) -> bool:
    """Whether this backend runs faster on a ``[D, V]`` weight
    (``head.weight_layout == "dv"``) given transposed, a copy per step
    (``x.weight`` may be a ``jax.ShapeDtypeStruct``)."""
    ...


class LogitsCE(Protocol):
  """Blockwise cross-entropy of given logits ``[rows, V]`` (float32 or bfloat16).

  A backend that supports class weights takes ``class_weights=`` (the
  columns', ``[V]``) in ``forward`` and ``backward``; it is given the keyword
  only when there are weights.
  """

  def forward(self, logits, labels, options: CEOptions, **weights) -> RowStats:
    """Reduces ``logits`` with ``labels`` relative to their first column."""
    ...

  def backward(
    self,
    logits,
    labels,
    rows,
    options: CEOptions,
    out_dtype,
    vocab_size=None,
    **weights,
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

  def chunk_logits(self, x: ChunkInputs, head: HeadSpec) -> jax.Array:
    return matmul.logits_matmul(
      x.hidden,
      x.weight,
      x.bias,
      head.weight_layout,
      head.logits_dtype,
      tile=head.matmul_tile,
      gemm=head.gemm,
      bound=x.bound,
    )

  def logits_and_stats(self, x: ChunkInputs, head: HeadSpec, offset):
    """The chunk's logits, and the ``RowStats`` of these columns (labels
    relative to ``offset``) where the GEMM forms them too, else None."""
    return self.chunk_logits(x, head), None

  def dlogits_width(self, x: ChunkInputs, head: HeadSpec) -> int:
    return matmul.vocab_size(x.weight, head.weight_layout)

  def transposes_weight(self, x: ChunkInputs, head: HeadSpec) -> bool:
    del x, head
    return False

  def chunk_forward(self, x, head, *, offset=0, logits=None):
    if logits is None:
      logits, stats = self.logits_and_stats(x, head, offset)
      if stats is not None:
        return stats
    labels = relative_labels(x.labels, offset)
    return self.forward(logits, labels, head.options, **_weights(x))

  def chunk_backward(self, x, rows, head, out_dtype, *, offset=0, logits=None):
    logits = self.chunk_logits(x, head) if logits is None else logits
    labels = relative_labels(x.labels, offset)
    return self.backward(
      logits, labels, rows, head.options, out_dtype, head.vocab_size, **_weights(x)
    )

  def chunk_forward_backward(self, x, g_loss, head, out_dtype, *, valid, columns, into):
    if into is None:
      logits, stats = self.logits_and_stats(x, head, columns.offset())
    else:  # the fused sweep writes dlogits into the group's buffer in place
      logits, stats = self.chunk_logits(x, head), None
    if stats is None and not columns.split and x.classes is None:
      options = head.options
      return self.forward_backward(
        logits, x.labels, valid, g_loss, options, out_dtype, into=into
      )
    return unfused_forward_backward(
      self,
      logits,
      x.labels,
      valid,
      g_loss,
      head.options,
      out_dtype,
      into=into,
      columns=columns,
      vocab_size=head.vocab_size,
      classes=x.classes,
      stats=stats,
      **_weights(x),
    )


def _weights(x: ChunkInputs) -> dict:
  """The class-weight argument of a ``LogitsCE`` call, when there are weights
  (a backend without class-weight support is never given any)."""
  return {} if x.class_weights is None else {"class_weights": x.class_weights}


def unfused_forward_backward(
  backend: LogitsCE,
  logits: jax.Array,
  labels: jax.Array,
  valid: jax.Array,
  g_loss: jax.Array,
  options: CEOptions,
  out_dtype,
  *,
  into: tuple[jax.Array, jax.Array] | None,
  columns: Columns = AllColumns(),
  vocab_size: int | None = None,
  class_weights: jax.Array | None = None,
  classes: ClassRows | None = None,
  stats: RowStats | None = None,
  backward_writes_into: bool = False,
) -> tuple[RowStats, jax.Array]:
  """``forward_backward`` as a ``forward`` then a ``backward``.

  With split ``columns`` (a vocabulary shard), the shards' statistics are
  combined between the two, before any shard's ``dlogits``. ``vocab_size``:
  the whole vocabulary (default: the logits' width). ``class_weights`` (the
  columns') and ``classes`` (the rows') when there are class weights.
  ``stats``: the ``forward`` of these columns when already known (formed
  with the logits), else computed here. ``backward_writes_into``: the
  backend's ``backward`` takes ``into`` and writes the buffer itself.
  """
  vocab_size = vocab_size or logits.shape[-1]
  weights = {} if class_weights is None else {"class_weights": class_weights}
  local = relative_labels(labels, columns.offset())
  if stats is None:
    stats = backend.forward(logits, local, options, **weights)
  stats = columns.combine(stats, labels)
  rows = ce_math.backward_rows(
    g_loss,
    jnp.zeros_like(stats.lse),
    stats.lse,
    labels,
    valid,
    options,
    vocab_size,
    classes=classes,
  )
  written = {"into": into} if backward_writes_into else {}
  dlogits = backend.backward(
    logits, local, rows, options, out_dtype, vocab_size, **weights, **written
  )
  return stats, dlogits if backward_writes_into else write_into(into, dlogits)


def write_into(into: tuple[jax.Array, jax.Array] | None, dlogits: jax.Array):
  """``dlogits``, or (``into=(buffer, row)``) the buffer with them from ``row`` on."""
  if into is None:
    return dlogits
  buffer, row = into  # XLA fuses an elementwise dlogits into this, in place
  return lax.dynamic_update_slice_in_dim(buffer, dlogits, row, 0)


class DistillKernel:
  """A chunk's distillation loss and ``dlogits`` (``_kernels.select_distill``:
  ``XlaDistill``, ``triton.distill.PallasTritonDistill``,
  ``mosaic.distill.MosaicDistill``): ``in_place``, ``pads_logits`` and
  ``chunk_loss(student_logits, teacher_logits, labels, valid, g_loss,
  options, out_dtype)``, which returns ``_math.distill.chunk_loss``'s
  ``(loss, dlogits)`` with ``dlogits`` in ``out_dtype``.

  ``work_bytes``: what the kernel holds a logit besides both heads' logits
  and ``dlogits`` (the planner counts it).
  """

  work_bytes: int = 0

  def pads_logits(self, *dtypes) -> bool:
    """Whether logits padded to whole 64-column tiles are taken (Mosaic's);
    by default never: logits of any width."""
    del dtypes
    return False
