"""Per-chunk cross-entropy as Pallas kernels lowered through Triton.

Three kernels over a chunk's logits ``[R, V]`` (float32, or bfloat16 read into
float32; all math is float32 and ``ce_math``'s, as in the XLA backend):

1. ``_stats_kernel``: ``ce_math.RowStats`` (lse, target, mean logit, argmax,
   and the expected score for the entropy) in one online pass over each row.
2. ``_dlogits_kernel``: elementwise ``dlogits`` (``ce_math.dlogits_block``)
   from the saved per-row coefficients; one read and one write, in place when
   the logits are in the dtype of ``dlogits``.
3. ``_fused_kernel``: both in one launch, for a gradient formed in the same
   sweep as the loss: two reads, one write, ``dlogits`` over bfloat16 logits
   in place (each program reads a block before it writes it, and owns its rows).

On a CPU the kernels run in interpret mode (``triton.common``).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from mst_jax._kernels import base
from mst_jax._kernels.triton.common import (
  DEPRECATION,
  KernelBlocks,  # noqa: F401 -- imported from here by tests and the benchmark
  TritonKernels,
  label_logits,
  load_logits,
  load_rows,
  row_block,
  row_scalar,
)
from mst_jax._math import ce as ce_math
from mst_jax._math import online


def _row_stats(logits_ref, labels, row_slice, row_mask, *, options, block_v):
  """``RowStats`` of a row block: one pass with an online max / sum-exp.

  The pass keeps only running sums and, per row, the first vocabulary block
  whose max beats every earlier one; the target score and the argmax within
  that block are read after it, row by row (one logit, one block): a
  comparison and a reduction per block less than finding them in the pass.
  """
  n_cols = logits_ref.shape[1]
  block_rows = labels.shape[0]

  def body(col_block_index, carry):
    running, best_block = carry
    z, cols, col_mask = load_logits(
      logits_ref, row_slice, row_mask, col_block_index, block_v
    )
    capped = ce_math.scores(z, options)  # [block_rows, block_v]
    new, _, block_max = online.update(running, capped, col_mask[None, :], options)
    # A later block holds the first maximum only if strictly larger.
    best_block = jnp.where(block_max > running.row_max, col_block_index, best_block)
    return new, best_block

  dtype = ce_math.at_least_float32(logits_ref.dtype)
  indices = jnp.zeros((block_rows,), jnp.int32)
  init = (online.start(block_rows, dtype), indices)
  (row_max, sum_exp, total, weighted), best_block = lax.fori_loop(
    0, pl.cdiv(n_cols, block_v), body, init
  )
  target = ce_math.scores(
    label_logits(logits_ref, labels, row_slice, row_mask), options
  )
  argmax, row_ids = indices, jnp.arange(block_rows)
  for row in range(block_rows):  # the first index of the row's max, in its block
    one_row = pl.ds(row_slice.start + row, 1)
    row_ok = row_scalar(row_mask.astype(jnp.int32), row) != 0
    z, cols, col_mask = load_logits(
      logits_ref, one_row, row_ok[None], row_scalar(best_block, row), block_v
    )
    live = jnp.where(col_mask[None, :], ce_math.scores(z, options), -jnp.inf)
    is_max = live == jnp.max(live, axis=1, keepdims=True)
    first = jnp.min(jnp.where(is_max, cols[None, :], n_cols))
    argmax = jnp.where(row_ids == row, first, argmax)
  return ce_math.RowStats(
    row_max=row_max,
    log_sum_exp=jnp.log(sum_exp),
    target=target,
    mean_logit=total / n_cols,
    argmax=argmax,
    expected_score=weighted / sum_exp if options.entropy else None,
  )


def _store_stats(stats, refs, row_slice, row_mask):
  values = [value for value in stats if value is not None]
  for value, ref in zip(values, refs, strict=True):
    plgpu.store(ref.at[row_slice], value.astype(ref.dtype), mask=row_mask)


def _stats_kernel(
  logits_ref,  # [R, V] float32 or bfloat16 (float64 for float64 inputs)
  labels_ref,  # [R] int32
  *stats_refs,  # the RowStats fields, each [R]
  options: ce_math.CEOptions,
  block_rows: int,
  block_v: int,
):
  row_slice, row_mask = row_block(pl.program_id(0), block_rows, logits_ref.shape[0])
  labels = load_rows(labels_ref, row_slice, row_mask, 0)
  stats = _row_stats(
    logits_ref, labels, row_slice, row_mask, options=options, block_v=block_v
  )
  _store_stats(stats, stats_refs, row_slice, row_mask)


def _write_dlogits(
  refs, block, col_block_index, *, options, block_v, row_offset=0, vocab_total=None
):
  """Writes one ``[block_rows, block_v]`` block of ``dlogits``.

  ``refs`` are ``(logits_ref, dlogits_ref)``; ``block`` is the program's
  ``(row_slice, row_mask, labels, rows)`` (``rows``: its ``BackwardRows``).
  The rows land ``row_offset`` rows further down ``dlogits_ref`` (a group's
  buffer that the chunk writes into in place). ``vocab_total`` is the whole
  vocabulary when the logits are one shard of it (label smoothing's eps / V).
  """
  logits_ref, dlogits_ref = refs
  row_slice, row_mask, labels, rows = block
  n_cols = logits_ref.shape[1]
  col_block_index = jnp.asarray(col_block_index, jnp.int32)  # int64 loops under x64
  z, cols, col_mask = load_logits(
    logits_ref, row_slice, row_mask, col_block_index, block_v
  )
  grad = ce_math.dlogits_block(z, cols, labels, rows, options, vocab_total or n_cols)
  out_rows = pl.ds(row_slice.start + row_offset, row_slice.size)
  plgpu.store(
    dlogits_ref.at[out_rows, pl.ds(col_block_index * block_v, block_v)],
    grad.astype(dlogits_ref.dtype),
    mask=row_mask[:, None] & col_mask[None, :],
  )


def _dlogits_kernel(
  logits_ref,  # [R, V] float32 or bfloat16 (float64 for float64 inputs)
  labels_ref,  # [R] int32
  lse_ref,
  coef_softmax_ref,
  coef_target_ref,  # each [R] float32, see ce_math.BackwardRows
  *refs,  # [coef_entropy, expected_score (each [R] float32),] dlogits [R, V]
  options: ce_math.CEOptions,
  block_rows: int,
  block_v: int,
  vocab_total: int,
):
  *entropy_refs, dlogits_ref = refs
  row_slice, row_mask = row_block(pl.program_id(0), block_rows, logits_ref.shape[0])
  labels = load_rows(labels_ref, row_slice, row_mask, 0)
  rows = ce_math.BackwardRows(
    # Padded rows: lse=+inf and zero coefficients give exactly 0, never NaN.
    lse=load_rows(lse_ref, row_slice, row_mask, jnp.inf),
    coef_softmax=load_rows(coef_softmax_ref, row_slice, row_mask, 0.0),
    coef_target=load_rows(coef_target_ref, row_slice, row_mask, 0.0),
  )
  if entropy_refs:
    coef_entropy, expected = (
      load_rows(ref, row_slice, row_mask, 0.0) for ref in entropy_refs
    )
    rows = rows._replace(coef_entropy=coef_entropy, expected_score=expected)
  _write_dlogits(
    (logits_ref, dlogits_ref),
    (row_slice, row_mask, labels, rows),
    pl.program_id(1),
    options=options,
    block_v=block_v,
    vocab_total=vocab_total,
  )


def _fused_kernel(
  logits_ref,  # [R, V] float32 or bfloat16 (float64 for float64 inputs)
  labels_ref,  # [R] int32
  valid_ref,  # [R] int32 (0 or 1)
  g_loss_ref,  # [R] float32, cotangent of each row's loss
  offset_ref,  # [1] int32: first row of dlogits to write
  *refs,  # [the group buffer (aliased),] the RowStats fields, dlogits
  options: ce_math.CEOptions,
  block_rows: int,
  block_v: int,
  into: bool,
):
  if into:  # the aliased input is the output dlogits_ref; nothing to read
    refs = refs[1:]
  *stats_refs, dlogits_ref = refs
  row_offset = offset_ref[0]
  n_rows, n_cols = logits_ref.shape
  row_slice, row_mask = row_block(pl.program_id(0), block_rows, n_rows)
  labels = load_rows(labels_ref, row_slice, row_mask, 0)
  stats = _row_stats(
    logits_ref, labels, row_slice, row_mask, options=options, block_v=block_v
  )
  _store_stats(stats, stats_refs, row_slice, row_mask)
  rows = ce_math.backward_rows(
    load_rows(g_loss_ref, row_slice, row_mask, 0.0),
    jnp.zeros_like(stats.lse),
    stats.lse,
    labels,
    load_rows(valid_ref, row_slice, row_mask, 0) != 0,
    options,
    n_cols,
  )

  @pl.loop(0, pl.cdiv(n_cols, block_v))
  def _(col_block_index):
    _write_dlogits(
      (logits_ref, dlogits_ref),
      (row_slice, row_mask, labels, rows),
      col_block_index,
      options=options,
      block_v=block_v,
      row_offset=row_offset,
    )


def _row_shapes(logits, options):
  """Output shapes of ``RowStats`` for ``logits``: four float rows, an int row,
  and with ``options.entropy`` a float row (``expected_score``)."""
  row = jax.ShapeDtypeStruct((logits.shape[0],), ce_math.at_least_float32(logits.dtype))
  index = jax.ShapeDtypeStruct((logits.shape[0],), jnp.int32)
  return (row, row, row, row, index, *[row] * options.entropy)


@dataclasses.dataclass(frozen=True)
class PallasTritonChunkCE(base.MatmulThenCE, TritonKernels):
  """The logits GEMM, then the cross-entropy as Pallas kernels lowered through
  Triton (``blocks`` and ``interpret``: ``TritonKernels``)."""

  def forward(self, logits, labels, options):
    n_rows, vocab_size = logits.shape
    call = self._call(
      functools.partial(_stats_kernel, options=options),
      "mst_ce_stats",
      lambda b: (pl.cdiv(n_rows, b.block_rows),),
      _row_shapes(logits, options),
      vocab_size,
      n_inputs=2,
    )
    return ce_math.RowStats(*call(logits, labels))

  def backward(self, logits, labels, rows, options, out_dtype, vocab_size=None):
    n_rows, n_cols = logits.shape
    # dlogits overwrite logits of their own dtype: each program reads its block
    # before it writes it, and the recomputed logits have no other reader.
    in_place = jnp.dtype(logits.dtype) == jnp.dtype(out_dtype)
    kernel = functools.partial(
      _dlogits_kernel, options=options, vocab_total=vocab_size or n_cols
    )
    call = self._call(
      kernel,
      "mst_ce_dlogits",
      lambda b: (pl.cdiv(n_rows, b.block_rows), pl.cdiv(n_cols, b.block_v)),
      jax.ShapeDtypeStruct(logits.shape, out_dtype),
      n_cols,
      n_inputs=7 if options.entropy else 5,
      aliases={0: 0} if in_place else None,
    )
    entropy_rows = (rows.coef_entropy, rows.expected_score) if options.entropy else ()
    return call(
      logits, labels, rows.lse, rows.coef_softmax, rows.coef_target, *entropy_rows
    )

  def forward_backward(
    self, logits, labels, valid, g_loss, options, out_dtype, *, into=None
  ):
    if options.entropy:  # linear_log_probs: per-token outputs, never fused
      raise NotImplementedError("the fused sweep has no entropy cotangent")
    n_rows, vocab_size = logits.shape
    n_outputs = len(_row_shapes(logits, options)) + 1
    if into is None:
      dlogits_shape = jax.ShapeDtypeStruct(logits.shape, out_dtype)
      offset, extra = jnp.zeros((1,), jnp.int32), ()
      # dlogits overwrite logits of their own dtype (input 0, the last output).
      in_place = jnp.dtype(logits.dtype) == jnp.dtype(out_dtype)
      aliases = {0: n_outputs - 1} if in_place else {}
    else:
      buffer, offset = into
      dlogits_shape = jax.ShapeDtypeStruct(buffer.shape, buffer.dtype)
      offset, extra = jnp.reshape(offset, (1,)).astype(jnp.int32), (buffer,)
      aliases = {5: n_outputs - 1}  # the group buffer, the last input
    call = self._call(
      functools.partial(_fused_kernel, options=options, into=into is not None),
      "mst_ce_fused",
      lambda b: (pl.cdiv(n_rows, b.block_rows),),
      (*_row_shapes(logits, options), dlogits_shape),
      vocab_size,
      n_inputs=5 + len(extra),
      aliases=aliases,
    )
    *stats, dlogits = call(
      logits, labels, valid.astype(jnp.int32), g_loss, offset, *extra
    )
    return ce_math.RowStats(*stats), dlogits


def smoke_test() -> None:
  """Lowers and compiles the statistics kernel for the default device.

  Only lowers and compiles (no execution), so it is safe to call while a
  caller's function is being traced. Quiet about Pallas's Triton
  deprecation: this is a probe (the Mosaic kernels' planning asks it about
  a fallback that a step may not use), and the kernels a step does run
  warn as they lower.
  """
  logits = jax.ShapeDtypeStruct((3, 130), jnp.float32)
  labels = jax.ShapeDtypeStruct((3,), jnp.int32)
  forward = functools.partial(
    PallasTritonChunkCE().forward, options=ce_math.CEOptions()
  )
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", DEPRECATION, DeprecationWarning)
    jax.jit(forward).lower(logits, labels).compile()
