"""Per-chunk cross-entropy as Pallas kernels lowered through Mosaic GPU (Hopper).

Two kernels over a chunk's logits ``[R, V]``, 16-bit or float32 (all math in
float32 and ``ce_math``'s, as in the other backends):

1. ``_stats_kernel``: the ``RowStats`` of a ``[block_rows, V / parts]`` slab,
   in one online pass over ``[block_rows, block_v]`` tiles that TMA streams
   into shared memory ahead of the math (``stages`` deep). The vocabulary is
   cut into ``parts`` so that a chunk of few rows still gives every SM work;
   ``ce_math.combine_stats`` merges the parts' statistics.
2. ``_dlogits_kernel``: elementwise ``dlogits`` (``ce_math.dlogits_block``)
   over the same tiles, written over the logits (``dlogits`` in their dtype),
   from float32 logits into a new 16-bit array, or (the fused sweep's whole
   groups) into rows of a group's buffer, at a row read from device memory
   (``launch``'s ``at_row``).

With class weights and label smoothing, both kernels also walk the tiles'
columns of the ``[V]`` class weights: the statistics weigh the scores' sum by
them, and ``dlogits`` read each column's weight (``ce_math.dlogits_block``).

A loss and its gradient in one sweep are the two kernels in turn (the Triton
backend fuses them into one launch, which measured faster on the H200:
docs/benchmarks.md). Where the Mosaic GEMM forms the chunk's 16-bit logits (no
bias, no class weights with smoothing; before jaxlib 0.12:
``mosaic_gemm.fuses_row_epilogues``), the statistics come from that GEMM's
epilogue instead (``mosaic_stats.TileStats``) and only ``_dlogits_kernel``
reads the logits.

The kernels take logits of ``8 i`` rows and ``64 j`` columns (``32 j`` in
float32: whole TMA tiles, ``mosaic_launch.takes``). The Mosaic GEMM forms
the logits (16-bit or float32) of a vocabulary of other widths (GPT-2's
50257) padded to whole 64-column tiles (``_gemm.matmul.mosaic_logits``), and
their ``dlogits`` and a group's buffer are as wide (``dlogits_width``): the
statistics leave the padding out, ``dlogits`` are zero there, and the
products of ``dlogits`` read only the weight's columns. What
the kernels do not take (other shapes and dtypes, a group's buffer written
at rows that are not whole row blocks) goes to what
``MosaicChunkCE.fallback`` makes (with class weights, XLA's chunk).
``mosaic_launch`` launches them, on a Hopper GPU or in interpret mode.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from mst_jax._gemm import matmul
from mst_jax._gemm.mosaic import gemm as mosaic_gemm
from mst_jax._kernels import base
from mst_jax._kernels.mosaic import stats as mosaic_stats
from mst_jax._kernels.mosaic.launch import Grid, MosaicBlocks, Program, launch, takes
from mst_jax._kernels.xla import XlaChunkCE
from mst_jax._math import ce as ce_math


def _stats_kernel(
  logits_ref,  # [R, V] 16-bit or float32
  labels_ref,  # [R] int32
  *refs,  # weighted: the [V] float32 class weights; then [parts, R] each:
  # mosaic_stats.finish's values
  program: Program,
  options: ce_math.CEOptions,
  n_cols: int,
  weighted: bool,
):
  column_refs, out_refs = refs[:weighted], refs[weighted:]

  def body(labels, first_col, tile_ref, *rest):
    *weights, carry = rest
    weights = program.columns(weights[0]) if weighted else None
    tile = tile_ref[...].astype(jnp.float32)
    return mosaic_stats.merge(carry, tile, first_col, labels, options, n_cols, weights)

  def with_labels(values):
    (labels,) = values
    walk_body = functools.partial(body, labels)
    return program.walk(
      walk_body,
      [logits_ref, *column_refs],
      init=mosaic_stats.start(labels.shape[0]),
    )

  carry = program.with_rows([labels_ref], with_labels)
  program.store_rows(out_refs, mosaic_stats.finish(carry, options))


def _dlogits_kernel(
  labels_ref,  # [R] int32
  *refs,  # [R] float32 each: BackwardRows' fields (target_weight last);
  # weighted: the [V] float32 class weights; then the [R, V] logits
  program: Program,
  options: ce_math.CEOptions,
  vocab_total: int,
  n_cols: int,
  in_place: bool,
  weighted: bool,
):
  """Writes ``dlogits`` over the logits (``in_place``) or into the ``[R, V]``
  ref after them, zeros from column ``n_cols`` on (the padding of padded
  logits)."""
  n_rows = 3 + 2 * options.entropy + weighted
  row_refs, column_refs = refs[:n_rows], refs[n_rows : n_rows + weighted]
  logits_ref, *out_ref = refs[n_rows + weighted :]
  out_ref = logits_ref if in_place else out_ref[0]
  shape = (program.blocks.block_rows, program.blocks.block_v)

  def with_rows(values):
    labels, *values = values
    rows = ce_math.BackwardRows(*values[:3])
    if options.entropy:
      rows = rows._replace(coef_entropy=values[3], expected_score=values[4])
    if weighted:
      rows = rows._replace(target_weight=values[-1])

    def body(first_col, tile_ref, *refs):
      *weights, out_ref = refs
      weights = program.columns(weights[0]) if weighted else None
      cols = first_col + lax.broadcasted_iota(jnp.int32, shape, 1)
      logits = tile_ref[...].astype(jnp.float32)
      grad = ce_math.dlogits_block(
        logits, cols, labels, rows, options, vocab_total, weights
      )
      grad = jnp.where(cols < n_cols, grad, 0.0)
      out_ref[...] = grad.astype(out_ref.dtype)

    program.walk(body, [logits_ref, *column_refs], [out_ref])

  program.with_rows([labels_ref, *row_refs], with_rows)


@dataclasses.dataclass(frozen=True)
class MosaicChunkCE(base.MatmulThenCE):
  """The logits GEMM, then the cross-entropy as Pallas kernels lowered
  through Mosaic GPU where they take the logits (``takes``), else by
  ``fallback``; with the Mosaic GEMMs (``HeadSpec.gemm``), the statistics
  in the logits GEMM's epilogue (``logits_and_stats``).

  Attributes:
    fallback: makes the ``LogitsCE`` for what the kernels do not take (other
      shapes and dtypes, an ``into`` that ``_writes_into`` refuses), called
      only when a chunk needs it; with class weights XLA's chunk runs
      instead (``_fallback``).
    tiles: the kernels' tiles.
    interpret: run the kernels in Pallas interpret mode (on a CPU too).
    weight_columns: the weight's number of columns, where the logits are
      padded past them (set per chunk by ``_scoring``): the statistics leave
      the rest out, and ``dlogits`` are zero there.
    bound: the chunk's ``ChunkInputs.bound`` (set per chunk by ``_scoring``,
      an int32 scalar known on the device): the kernels skip the row blocks
      from it on.
  """

  fallback: Callable[[], base.LogitsCE] = XlaChunkCE
  tiles: MosaicBlocks = MosaicBlocks()
  interpret: bool = False
  weight_columns: int | None = None
  bound: jax.Array | None = None

  def _padded(self, x: base.ChunkInputs, head: base.HeadSpec) -> bool:
    """Whether the chunk's logits come from the Mosaic GEMM, padded to whole
    64-column tiles (``_gemm.matmul.mosaic_logits``, a bias added), for these
    kernels alone, where that GEMM takes them (``head.gemm`` is ``"mosaic"``
    on a Hopper GPU alone)."""
    return head.gemm == "mosaic" and matmul.mosaic_takes_logits(
      x.hidden,
      x.weight,
      head.weight_layout,
      head.logits_dtype,
      bias=x.bias,
      here=False,
    )

  def dlogits_width(self, x: base.ChunkInputs, head: base.HeadSpec) -> int:
    n_cols = matmul.vocab_size(x.weight, head.weight_layout)
    return matmul.padded_width(n_cols) if self._padded(x, head) else n_cols

  def transposes_weight(self, x: base.ChunkInputs, head: base.HeadSpec) -> bool:
    """True for a ``[D, V]`` weight whose rows TMA cannot copy (V not whole
    64-column tiles: GPT-2's 50257), which would leave the products of
    whole-vocabulary chunks (with vocabulary blocks, the last block's) to
    XLA's GEMMs and the fallback, where its transpose's padded logits
    (``_padded``) run on the Mosaic kernels: a copy of the weight (and one
    of its gradient) takes a fraction of a step's time."""
    if head.weight_layout != "dv" or head.gemm != "mosaic" or self._padded(x, head):
      return False
    d, v = x.weight.shape
    transposed = jax.ShapeDtypeStruct((v, d), x.weight.dtype)
    return self._padded(
      x._replace(weight=transposed), dataclasses.replace(head, weight_layout="vd")
    )

  def _scoring(self, x: base.ChunkInputs, head: base.HeadSpec) -> MosaicChunkCE:
    """This backend for the chunk: over padded logits (``_padded``), one
    that scores the weight's columns only; with a bound, one whose kernels
    stop there."""
    changes = {}
    if self._padded(x, head):
      changes["weight_columns"] = matmul.vocab_size(x.weight, head.weight_layout)
    if x.bound is not None:
      changes["bound"] = x.bound
    return dataclasses.replace(self, **changes) if changes else self

  def chunk_logits(self, x: base.ChunkInputs, head: base.HeadSpec) -> jax.Array:
    """The chunk's logits, padded to whole 64-column tiles where ``_padded``
    (zeros past the weight's columns)."""
    logits = None
    if self._padded(x, head):
      logits = matmul.mosaic_logits(
        x.hidden,
        x.weight,
        head.weight_layout,
        head.logits_dtype,
        bias=x.bias,
        bound=x.bound,
      )
    return super().chunk_logits(x, head) if logits is None else logits

  def logits_and_stats(self, x: base.ChunkInputs, head: base.HeadSpec, offset):
    """The chunk's logits (``chunk_logits``) and, for 16-bit logits, their
    ``RowStats`` from one Mosaic GEMM, computed in its epilogue
    (``mosaic_stats.TileStats``), so nothing reads the logits back for them;
    the logits alone (statistics None) where that GEMM does not run (XLA's
    GEMMs, a bias, shapes it does not take) or fuse the epilogue (jaxlib
    0.12 on), with class weights (label
    smoothing's, which the epilogue does not weigh the scores by) and for
    float32 logits (whose tile would take all of the epilogue's registers).

    The statistics leave the padding of padded logits out, and the chunk's
    ``dlogits`` over them are padded alike (``_gemm.matmul`` reads them against
    the weight's columns only)."""
    sixteen_bits = jnp.dtype(head.logits_dtype).itemsize == 2
    plain = x.bias is None and x.class_weights is None
    if not (self._padded(x, head) and sixteen_bits and plain):
      return self.chunk_logits(x, head), None
    n_cols = matmul.vocab_size(x.weight, head.weight_layout)
    epilogue = mosaic_stats.TileStats(head.options, n_cols)
    labels = base.relative_labels(x.labels, offset).astype(jnp.int32)
    fused = matmul.mosaic_logits(
      x.hidden,
      x.weight,
      head.weight_layout,
      head.logits_dtype,
      epilogue,
      (labels,),
      bound=x.bound,
    )
    if fused is None:
      return self.chunk_logits(x, head), None
    logits, outputs, part_cols = fused
    widths = mosaic_stats.part_widths(n_cols, part_cols)
    return logits, mosaic_stats.combine(outputs, widths, n_cols, head.options)

  def chunk_forward(self, x, head, *, offset=0, logits=None):
    scoring = super(MosaicChunkCE, self._scoring(x, head))
    return scoring.chunk_forward(x, head, offset=offset, logits=logits)

  def chunk_backward(self, x, rows, head, out_dtype, *, offset=0, logits=None):
    scoring = super(MosaicChunkCE, self._scoring(x, head))
    return scoring.chunk_backward(
      x, rows, head, out_dtype, offset=offset, logits=logits
    )

  def chunk_forward_backward(self, x, g_loss, head, out_dtype, *, valid, columns, into):
    scoring = super(MosaicChunkCE, self._scoring(x, head))
    return scoring.chunk_forward_backward(
      x, g_loss, head, out_dtype, valid=valid, columns=columns, into=into
    )

  def _fallback(self, class_weights) -> base.LogitsCE:
    """What runs what the kernels do not take: ``fallback``, or with class
    weights XLA's chunk (the Triton kernels take none)."""
    return self.fallback() if class_weights is None else XlaChunkCE()

  def forward(self, logits, labels, options, class_weights=None):
    """``LogitsCE.forward``; ``class_weights`` (``[V]``, or the weight's
    columns of padded logits) weigh the scores' sum (label smoothing's)."""
    n_cols = self.weight_columns or logits.shape[1]
    if not options.label_smoothing:
      class_weights = None  # what they weigh is not computed
    weights = [] if class_weights is None else [class_weights.astype(jnp.float32)]
    if not takes(logits):
      logits = logits[:, :n_cols]  # the fallback reads the weight's columns only
      return self._fallback(class_weights).forward(logits, labels, options, *weights)
    n_rows, width = logits.shape
    grid = Grid.of(n_rows, width, self.tiles)
    out_type = [
      jax.ShapeDtypeStruct((grid.parts, n_rows), dtype)
      for dtype in mosaic_stats.out_dtypes(options)
    ]
    kernel = functools.partial(
      _stats_kernel, options=options, n_cols=n_cols, weighted=bool(weights)
    )
    bound = () if self.bound is None else (self.bound,)
    n_weights = len(weights)

    def run(logits, labels, *args):  # the bound an argument: under custom_vmap
      return launch(
        kernel,
        "mst_ce_stats_mosaic",
        grid,
        [labels],
        out_type,
        [logits],
        tiles=self.tiles,
        interpret=self.interpret,
        approx=mosaic_stats.approx_math(options),
        columns=args[:n_weights],
        bound=(*args[n_weights:], None)[0],
      )

    outputs = mosaic_gemm.unbatched(run)(logits, labels, *weights, *bound)
    part_cols = grid.steps * self.tiles.block_v
    widths = mosaic_stats.part_widths(n_cols, part_cols)
    sums = None
    if weights:  # each part's sum of class weights
      (w,) = weights
      w = jnp.pad(w, (0, grid.parts * part_cols - w.shape[0]))
      sums = jnp.sum(w.reshape(grid.parts, part_cols), axis=1, keepdims=True)
    return mosaic_stats.combine(outputs, widths, n_cols, options, sums)

  def backward(
    self,
    logits,
    labels,
    rows,
    options,
    out_dtype,
    vocab_size=None,
    class_weights=None,
    *,
    into=None,
  ):
    """``LogitsCE.backward``; with ``into=(buffer, row)`` (``_writes_into``)
    the ``dlogits`` go into the buffer's rows from ``row`` on, in place, and
    the buffer is returned. ``class_weights`` as in ``forward``, read where
    ``rows.target_weight`` is given (label smoothing)."""
    n_rows, width = logits.shape
    n_cols = self.weight_columns or width
    if rows.target_weight is None:
      class_weights = None  # the label's weight is in coef_target
    weights = [] if class_weights is None else [class_weights.astype(jnp.float32)]
    if not (takes(logits) and takes(jax.ShapeDtypeStruct(logits.shape, out_dtype))):
      weights = [jnp.pad(w, (0, width - w.shape[0])) for w in weights]
      dlogits = self._fallback(class_weights).backward(
        logits, labels, rows, options, out_dtype, vocab_size or n_cols, *weights
      )
      if n_cols == width:
        return dlogits
      cols = lax.broadcasted_iota(jnp.int32, dlogits.shape, 1)
      return jnp.where(cols < n_cols, dlogits, jnp.zeros_like(dlogits))
    grid = Grid.of(n_rows, width, self.tiles)
    row_values = [labels, rows.lse, rows.coef_softmax, rows.coef_target]
    if options.entropy:
      row_values += [rows.coef_entropy, rows.expected_score]
    if weights:
      row_values.append(rows.target_weight)
    in_place = into is None and jnp.dtype(out_dtype) == logits.dtype
    kernel = functools.partial(
      _dlogits_kernel,
      options=options,
      vocab_total=vocab_size or n_cols,
      n_cols=n_cols,
      in_place=in_place,
      weighted=bool(weights),
    )
    run = functools.partial(
      launch,
      kernel,
      "mst_ce_dlogits_mosaic",
      grid,
      row_values,
      None,
      tiles=self.tiles,
      interpret=self.interpret,
      approx=mosaic_stats.approx_math(options),
      columns=weights,
      bound=self.bound,
    )
    if into is not None:  # into a group's buffer (XLA aliases it, as below)
      buffer, row = into
      ref = jax.new_ref(buffer)
      run([logits, ref], at_row=row)
      return jax.freeze(ref)
    if not in_place:  # dlogits of another dtype than the logits': a new array
      return run([logits], new=out_dtype)
    # dlogits overwrite the logits (XLA aliases them where nothing else
    # reads them): each tile is read before it is written.
    ref = jax.new_ref(logits)
    run([ref])
    return jax.freeze(ref)

  def _writes_into(self, logits, out_dtype, into) -> bool:
    """Whether ``backward`` writes these logits' ``dlogits`` into
    ``into=(buffer, row)``: the logits in whole row blocks (nothing written
    past their rows), a buffer of ``out_dtype`` and their width in whole TMA
    tiles. ``row``, known only on the device, must be a multiple of the
    logits' rows (the fused sweep's chunks tile their group), so of the row
    blocks: only an int is checked."""
    buffer, row = into
    return (
      logits.shape[0] % self.tiles.block_rows == 0
      and not (isinstance(row, int) and row % self.tiles.block_rows)
      and buffer.shape[1] == logits.shape[1]
      and jnp.dtype(buffer.dtype) == jnp.dtype(out_dtype)
      and takes(buffer)
    )

  def forward_backward(
    self, logits, labels, valid, g_loss, options, out_dtype, *, into=None
  ):
    args = (logits, labels, valid, g_loss, options, out_dtype)
    writes = into is not None and self._writes_into(logits, out_dtype, into)
    if self.weight_columns is None and (
      not takes(logits) or (into is not None and not writes)
    ):
      return self.fallback().forward_backward(*args, into=into)
    # Padded logits stay here: ``forward`` and ``backward`` give the
    # fallback the weight's columns and pad its dlogits.
    return base.unfused_forward_backward(
      self,
      *args,
      into=into,
      vocab_size=self.weight_columns,
      backward_writes_into=writes,
    )
