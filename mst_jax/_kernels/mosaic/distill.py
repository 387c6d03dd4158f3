"""Per-chunk distillation as Pallas kernels lowered through Mosaic GPU (Hopper).

Over a chunk's student and teacher logits ``[R, V]`` (each 16-bit or
float32; math in float32 and ``_math.distill``'s, as the other backends), on
``mosaic_launch``'s tiles, vocabulary parts and TMA pipelines:

1. ``_stats_kernel``: each ``[block_rows, V / parts]`` slab's
   ``DistillStats``, in one pass over tiles of both heads; a tree of
   ``_math.distill.combine`` merges the parts' (``_merge_parts``);
2. ``_jsd_kernel`` (``divergence="jsd"``): the JSD's two sums, given the
   whole rows' normalizers, in a second pass;
3. ``_dlogits_kernel``: the student's ``dlogits`` (``dlogits_block``),
   written over the student's logits, or (float32 logits, 16-bit
   ``dlogits``) into a new array.

Each row's loss and the ``DistillRows`` of its gradient (``finish``) are
formed in XLA between the passes: a few ``[R]`` vectors. What the kernels do
not take (shapes that are not whole TMA tiles) goes to what
``MosaicDistill.fallback`` makes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from mst_jax._gemm import matmul
from mst_jax._gemm.mosaic import gemm as mosaic_gemm
from mst_jax._kernels.base import DistillKernel
from mst_jax._kernels.mosaic import launch as mosaic_launch
from mst_jax._kernels.mosaic import stats as mosaic_stats
from mst_jax._kernels.xla import XlaDistill
from mst_jax._math import ce as ce_math
from mst_jax._math import distill as distill_math


def _tempered_tile(first_col, student_ref, teacher_ref, options, n_cols):
  """``(s_s, u, v)`` of a tile (``_math.distill.tempered``), -inf from
  column ``n_cols`` on."""
  shape = student_ref.shape
  inside = first_col + lax.broadcasted_iota(jnp.int32, shape, 1) < n_cols
  z_s = student_ref[...].astype(jnp.float32)
  z_t = teacher_ref[...].astype(jnp.float32)
  out = distill_math.tempered(z_s, z_t, options)
  return [jnp.where(inside, x, -jnp.inf) for x in out]


def _stats_kernel(
  student_ref,  # [R, V] 16-bit or float32
  teacher_ref,  # [R, V] likewise
  *out_refs,  # [parts, R] float32 each: DistillStats' fields that are not None
  program: mosaic_launch.Program,
  options: distill_math.DistillOptions,
  n_cols: int,
):
  def body(first_col, s_tile, t_tile, stats):
    tile = _tempered_tile(first_col, s_tile, t_tile, options, n_cols)
    block = distill_math.block_stats(*tile, options)
    return distill_math.combine(stats, block, options)

  rows = program.blocks.block_rows
  empty = distill_math.empty_stats((rows,), jnp.float32, options)
  stats = program.walk(body, [student_ref, teacher_ref], init=empty)
  program.store_rows(out_refs, [x for x in stats if x is not None])


def _jsd_kernel(
  student_ref,  # [R, V] 16-bit or float32
  teacher_ref,  # [R, V] likewise
  *refs,  # [R] float32: log_norms' four; then [parts, R] float32: the two sums
  program: mosaic_launch.Program,
  options: distill_math.DistillOptions,
  n_cols: int,
):
  *norm_refs, kl_p_ref, kl_q_ref = refs

  def with_norms(norms):
    def body(first_col, s_tile, t_tile, sums):
      _, u, v = _tempered_tile(first_col, s_tile, t_tile, options, n_cols)
      block = distill_math.jsd_sums(u, v, norms, options.beta)
      return sums[0] + block[0], sums[1] + block[1]

    zeros = jnp.zeros((program.blocks.block_rows,), jnp.float32)
    return program.walk(body, [student_ref, teacher_ref], init=(zeros, zeros))

  sums = program.with_rows(norm_refs, with_norms)
  program.store_rows([kl_p_ref, kl_q_ref], list(sums))


def _dlogits_kernel(
  labels_ref,  # [R] int32
  *refs,  # [R] float32 each: DistillRows' fields (valid as 0 / 1, then the
  # hard-label term's lse, coef_softmax, coef_target); then the teacher's
  # [R, V] logits and the student's, written over (in_place), else the
  # [R, V] array written
  program: mosaic_launch.Program,
  options: distill_math.DistillOptions,
  vocab_total: int,
  padded: bool,
  in_place: bool,
):
  if in_place:
    *row_refs, teacher_ref, student_ref = refs
    out_ref = student_ref
  else:
    *row_refs, teacher_ref, student_ref, out_ref = refs
  shape = (program.blocks.block_rows, program.blocks.block_v)

  def with_rows(values):
    labels, *values = values
    hard = None
    if options.hard_label_weight:
      hard = ce_math.BackwardRows(*values[7:10])
    valid = values[6] > 0.0
    rows = distill_math.DistillRows(*values[:6], valid=valid, hard=hard)

    def body(first_col, s_tile, t_tile, out_tile):
      cols = first_col + lax.broadcasted_iota(jnp.int32, shape, 1)
      z_s = s_tile[...].astype(jnp.float32)
      z_t = t_tile[...].astype(jnp.float32)
      grad = distill_math.dlogits_block(
        z_s, z_t, cols, labels, rows, options, vocab_total
      )
      if padded:  # zeros past the weight's columns
        grad = jnp.where(cols < vocab_total, grad, 0.0)
      out_tile[...] = grad.astype(out_tile.dtype)

    program.walk(body, [student_ref, teacher_ref], [out_ref])

  program.with_rows([labels_ref, *row_refs], with_rows)


def _halves(size: int) -> tuple[slice, slice]:
  return slice(None, size), slice(size, None)


def _merge_parts(parts: list, options) -> distill_math.DistillStats:
  """The whole rows' ``DistillStats`` from each part's (``[parts, R]``
  fields, None ones left out): halves merged with ``combine`` until one
  part is left (empty parts pad the count to a power of 2)."""
  fields = iter(parts)
  stats = distill_math.DistillStats(
    *(
      None if x is None else next(fields)
      for x in distill_math.empty_stats((), jnp.float32, options)
    )
  )
  count = stats.max_q.shape[0]
  size = 1 << (count - 1).bit_length()
  empty = distill_math.empty_stats(
    (size - count, stats.max_q.shape[1]), jnp.float32, options
  )
  stats = jax.tree.map(lambda x, e: jnp.concatenate([x, e]), stats, empty)
  while size > 1:
    size //= 2
    halves = [jax.tree.map(lambda x, s=s: x[s], stats) for s in _halves(size)]
    stats = distill_math.combine(*halves, options)
  return jax.tree.map(lambda x: x[0], stats)


def takes(student_logits, teacher_logits, out_dtype) -> bool:
  """Whether the Mosaic kernels take these heads (arrays or their shapes)
  and their ``dlogits`` in ``out_dtype``: of one shape, each 16-bit or
  float32 (the two dtypes may differ) in whole TMA tiles
  (``mosaic_launch.takes``)."""
  out = jax.ShapeDtypeStruct(student_logits.shape, out_dtype)
  return student_logits.shape == teacher_logits.shape and all(
    map(mosaic_launch.takes, (student_logits, teacher_logits, out))
  )


def _xla_chunk() -> XlaDistill:
  """``MosaicDistill``'s default fallback: XLA's chunk."""
  return XlaDistill()


@dataclasses.dataclass(frozen=True)
class MosaicDistill(DistillKernel):
  """A chunk's distillation loss and ``dlogits`` as Mosaic GPU kernels where
  they take the logits (``takes``), else by ``fallback``.

  Attributes:
    fallback: makes the kernel for what these do not take
      (``PallasTritonDistill``, or ``XlaDistill``: XLA's chunk); called only
      when a chunk needs it.
    tiles: the kernels' tiles.
    interpret: run the kernels in Pallas interpret mode (on a CPU too).
  """

  fallback: Callable[[], Any] = _xla_chunk
  tiles: mosaic_launch.MosaicBlocks = mosaic_launch.MosaicBlocks()
  interpret: bool = False

  def in_place(self, student_logits, teacher_logits, out_dtype) -> bool:
    """Whether ``dlogits`` (in ``out_dtype``) overwrite a chunk's student
    logits (arrays or their shapes): of the same dtype, where these kernels
    take the two heads, or where the fallback does (the Triton kernel; XLA's
    chunk never does). Heads these kernels take never ask for the fallback."""
    same = jnp.dtype(student_logits.dtype) == jnp.dtype(out_dtype)
    if not same:
      return False
    if takes(student_logits, teacher_logits, out_dtype):
      return True
    return self.fallback().in_place(student_logits, teacher_logits, out_dtype)

  def _launch(self, kernel, name, grid, rows, out_type, arrays, options, new=None):
    return mosaic_launch.launch(
      kernel,
      name,
      grid,
      rows,
      out_type,
      arrays,
      tiles=self.tiles,
      interpret=self.interpret,
      approx=mosaic_stats.approx_math(options.scores),
      new=new,
    )

  def pads_logits(self, student_dtype, teacher_dtype, out_dtype) -> bool:
    """Whether these kernels take logits of these dtypes whole, ``dlogits``
    in ``out_dtype`` over them: then a vocabulary that is not whole 64-column
    tiles (GPT-2's 50257) can come as logits padded to them
    (``_gemm.matmul.mosaic_logits``; ``chunk_loss``'s ``n_cols``)."""
    shape = (64, matmul.PADDED_COLUMNS)  # a row block of padded logits
    heads = [jax.ShapeDtypeStruct(shape, d) for d in (student_dtype, teacher_dtype)]
    return takes(*heads, out_dtype)

  def chunk_loss(
    self,
    student_logits,
    teacher_logits,
    labels,
    valid,
    g_loss,
    options,
    out_dtype,
    n_cols=None,
  ):
    """``_math.distill.chunk_loss``'s ``(loss, dlogits)``, ``dlogits`` in
    ``out_dtype`` (None without ``g_loss``).

    ``n_cols``: the weights' columns where the logits are padded past them
    (zeros): the loss leaves the padding out, and ``dlogits`` are zero there.
    """
    width = student_logits.shape[1]
    n_cols = width if n_cols is None else n_cols
    grad_dtype = student_logits.dtype if g_loss is None else jnp.dtype(out_dtype)
    if not takes(student_logits, teacher_logits, grad_dtype):
      heads = [student_logits, teacher_logits]
      if n_cols < width:  # the fallback reads the weights' columns only
        heads = [x[:, :n_cols] for x in heads]
      args = (*heads, labels, valid, g_loss, options)
      loss, dlogits = self.fallback().chunk_loss(*args, out_dtype)
      if dlogits is not None and n_cols < width:
        dlogits = jnp.pad(dlogits, ((0, 0), (0, width - n_cols)))
      return loss, dlogits
    n_rows = student_logits.shape[0]
    grid = mosaic_launch.Grid.of(n_rows, width, self.tiles)
    heads = [student_logits, teacher_logits]
    empty = distill_math.empty_stats((), jnp.float32, options)
    part = jax.ShapeDtypeStruct((grid.parts, n_rows), jnp.float32)
    kernel = functools.partial(_stats_kernel, options=options, n_cols=n_cols)
    run = lambda *heads: self._launch(
      kernel,
      "mst_distill_stats_mosaic",
      grid,
      [],
      [part for x in empty if x is not None],
      heads,
      options,
    )
    stats = _merge_parts(mosaic_gemm.unbatched(run)(*heads), options)
    sums = target = None
    if options.divergence == "jsd":
      kernel = functools.partial(_jsd_kernel, options=options, n_cols=n_cols)
      norms = list(distill_math.log_norms(stats))
      run = lambda *args: self._launch(
        kernel, "mst_distill_jsd_mosaic", grid, args[2:], [part] * 2, args[:2], options
      )
      kl_p, kl_q = mosaic_gemm.unbatched(run)(*heads, *norms)
      sums = kl_p.sum(axis=0), kl_q.sum(axis=0)
    if options.hard_label_weight:
      safe = jnp.clip(labels, 0, n_cols - 1)[:, None]
      raw = jnp.take_along_axis(student_logits, safe, axis=-1)[:, 0]
      # Only the loss reads this gather, and dlogits overwrite the logits it
      # reads: tied to the logits the kernel takes, it runs first, rather
      # than XLA copying the logits to keep them for it.
      student_logits, raw = lax.optimization_barrier((student_logits, raw))
      target = ce_math.scores(raw.astype(jnp.float32), options.scores)
    loss, rows = distill_math.finish(
      stats, sums, target, labels, valid, g_loss, options, n_cols
    )
    if rows is None:
      return loss, None
    row_values = [labels.astype(jnp.int32), *rows[:6], valid.astype(jnp.float32)]
    if rows.hard is not None:
      row_values += list(rows.hard[:3])
    in_place = grad_dtype == student_logits.dtype
    kernel = functools.partial(
      _dlogits_kernel,
      options=options,
      vocab_total=n_cols,
      padded=n_cols < width,
      in_place=in_place,
    )
    run = functools.partial(
      self._launch, kernel, "mst_distill_dlogits_mosaic", grid, row_values, None
    )
    if not in_place:  # 16-bit dlogits of float32 logits: a new array
      return loss, run([teacher_logits, student_logits], options, new=grad_dtype)
    # dlogits overwrite the student's logits (XLA aliases them where nothing
    # else reads them): each tile is read before it is written.
    ref = jax.new_ref(student_logits)
    run([teacher_logits, ref], options)
    return loss, jax.freeze(ref)
