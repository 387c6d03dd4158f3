"""Per-chunk distillation as one Pallas kernel lowered through Triton.

``_distill_kernel`` reads a chunk's student and teacher logits ``[R, V]``
(bfloat16 or float32, math in float32 and ``_math.distill``'s, as the XLA
chunk) and, per program of ``block_rows`` rows:

1. walks the vocabulary once, merging each block's ``DistillStats``
   (``block_stats`` / ``combine``); the JSD walks it again for its two sums;
2. forms each row's loss (``finish``) and writes it;
3. with a cotangent, walks the vocabulary once more and writes the student's
   ``dlogits`` (``dlogits_block``), over the student's logits in place when
   they have the dtype of ``dlogits`` (each program reads a block before it
   writes it, and owns its rows).

Each logit of both heads is read two (three for the JSD) times and ``dlogits``
written once, against the several passes of XLA's fusions.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from mst_jax._kernels.base import DistillKernel
from mst_jax._kernels.triton.common import (
  TritonKernels,
  label_logits,
  load_logits,
  load_rows,
  row_block,
)
from mst_jax._math import ce as ce_math
from mst_jax._math import distill as distill_math


def _distill_kernel(
  student_ref,  # [R, V] raw logits
  teacher_ref,  # [R, V] raw logits
  labels_ref,  # [R] int32
  valid_ref,  # [R] int32 (0 or 1)
  g_loss_ref,  # [R] float32 (read with a cotangent only)
  loss_ref,  # [R] float32
  *dlogits_ref,  # [R, V], with a cotangent
  options: distill_math.DistillOptions,
  block_rows: int,
  block_v: int,
):
  n_rows, n_cols = student_ref.shape
  dtype = ce_math.at_least_float32(student_ref.dtype)
  row_slice, row_mask = row_block(pl.program_id(0), block_rows, n_rows)
  labels = load_rows(labels_ref, row_slice, row_mask, 0)
  valid = load_rows(valid_ref, row_slice, row_mask, 0) != 0
  n_blocks = pl.cdiv(n_cols, block_v)

  def logits(col_block_index):
    z_s, cols, col_mask = load_logits(
      student_ref, row_slice, row_mask, col_block_index, block_v
    )
    z_t, _, _ = load_logits(
      teacher_ref, row_slice, row_mask, col_block_index, block_v, dtype
    )
    return z_s, z_t, cols, col_mask

  def tempered(col_block_index):
    """``(s_s, u, v)`` of a block, -inf beyond the vocabulary."""
    z_s, z_t, _, col_mask = logits(col_block_index)
    out = distill_math.tempered(z_s, z_t, options)
    return [jnp.where(col_mask[None, :], x, -jnp.inf) for x in out]

  def merge(col_block_index, stats):
    block = distill_math.block_stats(*tempered(col_block_index), options)
    return distill_math.combine(stats, block, options)

  empty = distill_math.empty_stats((block_rows,), dtype, options)
  stats = lax.fori_loop(0, n_blocks, merge, empty)
  sums = target = None
  if options.divergence == "jsd":
    norms = distill_math.log_norms(stats)

    def add(col_block_index, sums):
      _, u, v = tempered(col_block_index)
      block = distill_math.jsd_sums(u, v, norms, options.beta)
      return sums[0] + block[0], sums[1] + block[1]

    zeros = jnp.zeros((block_rows,), dtype)
    sums = lax.fori_loop(0, n_blocks, add, (zeros, zeros))
  if options.hard_label_weight:
    raw = label_logits(student_ref, labels, row_slice, row_mask)
    target = ce_math.scores(raw, options.scores)
  g_loss = load_rows(g_loss_ref, row_slice, row_mask, 0.0) if dlogits_ref else None
  loss, rows = distill_math.finish(
    stats, sums, target, labels, valid, g_loss, options, n_cols
  )
  plgpu.store(loss_ref.at[row_slice], loss.astype(loss_ref.dtype), mask=row_mask)
  if not dlogits_ref:
    return
  (dlogits_ref,) = dlogits_ref

  @pl.loop(0, n_blocks)
  def _(col_block_index):
    z_s, z_t, cols, col_mask = logits(col_block_index)
    grad = distill_math.dlogits_block(z_s, z_t, cols, labels, rows, options, n_cols)
    col_block_index = jnp.asarray(col_block_index, jnp.int32)
    plgpu.store(
      dlogits_ref.at[row_slice, pl.ds(col_block_index * block_v, block_v)],
      grad.astype(dlogits_ref.dtype),
      mask=row_mask[:, None] & col_mask[None, :],
    )


@dataclasses.dataclass(frozen=True)
class PallasTritonDistill(TritonKernels, DistillKernel):
  """A chunk's distillation loss and ``dlogits`` as one Pallas Triton kernel
  (``blocks`` and ``interpret``: ``TritonKernels``)."""

  def in_place(self, student_logits, teacher_logits, out_dtype) -> bool:
    """Whether ``dlogits`` (in ``out_dtype``) overwrite a chunk's student
    logits (arrays or their shapes): of the same dtype, whatever the shapes
    and the teacher's dtype."""
    return jnp.dtype(student_logits.dtype) == jnp.dtype(out_dtype)

  def chunk_loss(
    self, student_logits, teacher_logits, labels, valid, g_loss, options, out_dtype
  ):
    """``_math.distill.chunk_loss``'s ``(loss, dlogits)``, ``dlogits`` in
    ``out_dtype`` (None without ``g_loss``)."""
    n_rows, vocab_size = student_logits.shape
    loss_shape = jax.ShapeDtypeStruct(
      (n_rows,), ce_math.at_least_float32(student_logits.dtype)
    )
    out_shape, aliases = (loss_shape,), {}
    if g_loss is None:
      g_loss = jnp.zeros((1,), jnp.float32)  # not read
    else:
      out_shape += (jax.ShapeDtypeStruct(student_logits.shape, out_dtype),)
      if self.in_place(student_logits, teacher_logits, out_dtype):
        aliases = {0: 1}
    run = self._call(
      functools.partial(_distill_kernel, options=options),
      "mst_distill",
      lambda b: (pl.cdiv(n_rows, b.block_rows),),
      out_shape,
      vocab_size,
      n_inputs=5,
      aliases=aliases,
    )
    out = run(
      student_logits,
      teacher_logits,
      labels,
      valid.astype(jnp.int32),
      g_loss.astype(jnp.float32),
    )
    return out[0], (out[1] if len(out) > 1 else None)
