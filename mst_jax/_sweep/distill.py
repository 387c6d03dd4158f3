"""The chunked sweep of both heads behind ``linear_distillation_loss``.

Rows are walked in chunks (``_sweep.rows.sweep_chunks``, valid rows compacted to the
front, chunks without a valid row skipped by ``lax.cond``); per chunk both
heads' logits are formed (``_gemm.matmul.logits_matmul``, the teacher's under
``lax.stop_gradient``), the kernel of ``_kernels.select_distill`` (XLA's
chunk, Triton's or Mosaic GPU's) scores them, and the student's ``dlogits``
go into its ``dhidden`` rows, ``dweight`` and ``dbias`` through
cross-entropy's ``_sweep.gradients.gradient_sweep``.

``Plan`` is a ``_sweep.driver.SweepPlan``: the loss runs through the custom
VJPs cross-entropy's does. ``reduced_loss`` (a scalar reduction) forms the
gradients in the same sweep as the loss, ``6 N D_s V + 2 N D_t V`` FLOPs like
full-logits autodiff; ``row_losses`` (per-token losses, or
``grad_mode="recompute"``) keeps only the inputs and forms each chunk's logits
of both heads again in the backward (``8 N D_s V + 4 N D_t V`` FLOPs in all).
No cotangent ever reaches the teacher's arrays, so the program holds no
matmul for a teacher gradient. ``resolve`` decides every default (chunk rows
from a memory budget by ``_plan.rows_in_budget``, logits and accumulator
dtypes).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mst_jax import _plan
from mst_jax._args.options import PerfOptions, resolve_logits_dtype
from mst_jax._gemm import matmul
from mst_jax._kernels import (
  XlaDistill,
  select_distill,
  select_gemm,
)
from mst_jax._kernels.base import AllColumns, write_into
from mst_jax._math.ce import at_least_float32
from mst_jax._math.distill import DistillOptions
from mst_jax._plan import unit_weights
from mst_jax._sweep.gradients import Sweep, gradient_sweep
from mst_jax._sweep.row_chunks import RowChunks
from mst_jax._sweep.rows import Differentiated, compaction, stat_dtype, sweep_chunks


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything the sweep needs besides the arrays (static, hashable).

  Attributes:
    options: the loss options.
    weight_layout: ``"vd"`` or ``"dv"`` (both heads).
    rows_per_chunk: rows whose logits (of both heads) exist at once.
    logits_dtype: the dtype the student's logits matmul writes.
    teacher_logits_dtype: the teacher's.
    dweight_dtype: the ``dweight`` accumulator's dtype (the weight's own:
      ``dweight`` accumulates in place in the output).
    dbias_dtype: the ``dbias`` accumulator's.
    matmul_tile: vocabulary columns per matmul tile (XLA:CPU), or None.
    gemm: what runs the matmuls, ``"xla"`` or ``"mosaic"`` (``_gemm.matmul``).
    compact: move valid rows to the front before chunking.
    kernel: the per-chunk kernel (``_kernels.select_distill``).
    pad_logits: form each chunk's logits by the Mosaic GEMM padded to whole
      64-column tiles (``_gemm.matmul.mosaic_logits``), which the kernel reads
      against the weights' columns (``_pads_logits``).
  """

  options: DistillOptions
  weight_layout: str
  rows_per_chunk: int
  logits_dtype: np.dtype
  teacher_logits_dtype: np.dtype
  dweight_dtype: np.dtype
  dbias_dtype: np.dtype
  matmul_tile: int | None = None
  gemm: str = "xla"
  compact: bool = True
  kernel: Any = None
  pad_logits: bool = False
  columns: AllColumns = AllColumns()

  @property
  def layout(self) -> str:
    return self.weight_layout

  @property
  def runs_kernels(self) -> bool:
    """Whether the sweep runs Pallas or Mosaic kernels (no second derivatives)."""
    return not isinstance(self.kernel, XlaDistill) or self.gemm != "xla"

  def inputs(self, *arrays) -> Heads:
    return Heads(*arrays)

  def forward(self, x: Heads) -> tuple:
    """``(loss,)``: the per-row losses ``[N]``."""
    loss, _ = _chunk_sweep(self, x, None, Differentiated(False, False, False))
    return (loss,)

  def forward_keeping(self, x: Heads):
    return self.forward(x), None

  def saved(self, outputs: tuple) -> tuple:
    del outputs
    return ()

  def backward(self, x: Heads, saved, cotangents, diff, kept):
    del saved, kept
    (g_loss,) = cotangents
    _, grads = _chunk_sweep(self, x, g_loss, diff, want_loss=False)
    return grads

  def fused(self, x: Heads, row_scale, diff):
    loss, grads = _chunk_sweep(self, x, row_scale, diff)
    return (jnp.sum(loss * row_scale.astype(loss.dtype)),), grads

  def loss_cotangent(self, cotangents):
    (g_loss,) = cotangents
    return g_loss


class Heads(NamedTuple):
  """The sweep's arrays: the student's (differentiated) and the teacher's rows."""

  hidden: jax.Array  # [N, D_s]
  weight: jax.Array  # [V, D_s] or [D_s, V]
  bias: jax.Array | None  # [V]
  teacher_hidden: jax.Array  # [N, D_t]
  teacher_weight: jax.Array  # [V, D_t] or [D_t, V]
  teacher_bias: jax.Array | None  # [V]
  labels: jax.Array  # int32 [N]
  valid: jax.Array  # bool [N]


# ---- The sweep: chunks of rows, both heads' logits per chunk. ----


def _chunk_sweep(plan: Plan, x: Heads, g_loss, diff: Differentiated, *, want_loss=True):
  """``(loss, grads)``: per-row losses ``[N]`` (None without ``want_loss``) and
  the gradients of ``sum(g_loss * loss)`` (None where ``diff`` says an input
  is not differentiated, or without ``g_loss``).

  Each chunk's student ``dlogits`` become gradients as cross-entropy's do
  (``_sweep.gradients.gradient_sweep``), a chunk at a time."""
  gather, scatter, view = compaction(plan.compact, x.valid)
  rows = x._replace(
    hidden=view(x.hidden),
    teacher_hidden=view(x.teacher_hidden),
    labels=gather(x.labels),
    valid=gather(x.valid),
  )
  unit = scale = None
  if g_loss is not None and any(diff):
    (unit,), scale = unit_weights((gather(g_loss),), rows.valid, x.hidden.dtype)
  loss = jnp.zeros(x.labels.shape, stat_dtype(x.hidden)) if want_loss else None
  layout, tile, gemm = plan.weight_layout, plan.matmul_tile, plan.gemm

  def logits(h, h_t):
    if plan.pad_logits:
      student = matmul.mosaic_logits(
        h, x.weight, layout, plan.logits_dtype, bias=x.bias
      )
      teacher = matmul.mosaic_logits(
        h_t, x.teacher_weight, layout, plan.teacher_logits_dtype, bias=x.teacher_bias
      )
      if student is not None and teacher is not None:
        return student, teacher
    student = matmul.logits_matmul(
      h, x.weight, x.bias, layout, plan.logits_dtype, tile=tile, gemm=gemm
    )
    teacher = matmul.logits_matmul(
      h_t,
      x.teacher_weight,
      x.teacher_bias,
      layout,
      plan.teacher_logits_dtype,
      tile=tile,
      gemm=gemm,
    )
    return student, teacher

  def chunk_dlogits(loss, chunk, into):
    h = chunk.hidden(rows.hidden)
    student, teacher = logits(h, chunk.hidden(rows.teacher_hidden))
    g_rows = None if unit is None else chunk.take(unit)
    inputs = (student, lax.stop_gradient(teacher), chunk.take(rows.labels), chunk.valid)
    padded = dict(n_cols=matmul.vocab_size(x.weight, layout))
    row_loss, dlogits = plan.kernel.chunk_loss(
      *inputs, g_rows, plan.options, h.dtype, **(padded if plan.pad_logits else {})
    )
    if loss is not None:
      loss = chunk.put(loss, row_loss.astype(loss.dtype))
    return loss, None if dlogits is None else write_into(into, dlogits.astype(h.dtype))

  if unit is not None:
    order = RowChunks(plan.rows_per_chunk, plan.rows_per_chunk, plan.compact)
    loss, grads = gradient_sweep(
      Sweep(order, plan, rows, chunk_dlogits, scale), diff, loss
    )
  else:
    loss_only = lambda loss, chunk: chunk_dlogits(loss, chunk, None)[0]
    loss = sweep_chunks(plan.rows_per_chunk, rows.valid, loss_only, loss)
    grads = (None, None, None)
  return None if loss is None else scatter(loss), grads


# ---- Planning, at trace time. ----


def _chunk_heads(vocab: int, *dtypes) -> list[jax.ShapeDtypeStruct]:
  """The shapes of a chunk's logits of each head (``dtypes``): ``vocab``
  columns, rows a multiple of ``_plan.TMA_ROWS`` (what the chunks are,
  rows appended where not)."""
  return [jax.ShapeDtypeStruct((_plan.TMA_ROWS, vocab), d) for d in dtypes]


class Planned(NamedTuple):
  """``resolve``'s result: the plan, the heads it runs on (``[D, V]``
  weights transposed where ``transposed`` says so), and the rows to append
  to them (``_plan.tma_row_padding``; the plan counts them)."""

  plan: Plan
  heads: Heads
  rows_appended: int


def resolve(
  x: Heads, options: DistillOptions, perf: PerfOptions, layout: str
) -> Planned:
  """Every default decided once: the kernels, the weights' layout, the rows
  per chunk, the rows appended, the accumulators."""
  dtype, teacher_dtype = x.hidden.dtype, x.teacher_hidden.dtype
  logits_dtype = resolve_logits_dtype(perf.logits_dtype, dtype)
  teacher_logits_dtype = resolve_logits_dtype(perf.logits_dtype, teacher_dtype)
  platform = jax.default_backend()
  kernel, gemm = select_distill(perf.impl, platform), select_gemm(perf.impl, platform)
  dtypes = (logits_dtype, teacher_logits_dtype, dtype)
  budget = perf.memory_budget or _plan.DEFAULT_MEMORY_BUDGET
  if (flipped := transposed(x, layout, kernel, gemm, dtypes, budget)) is not None:
    # Outside the custom VJPs: autodiff transposes dweight back.
    x, layout, budget = flipped
  n_rows, vocab = x.hidden.shape[0], matmul.vocab_size(x.weight, layout)
  pad = _pads_logits(x, layout, kernel, gemm, *dtypes)
  if pad:  # the chunks' logits are this wide
    vocab = matmul.padded_width(vocab)
  per_logit = logits_dtype.itemsize + teacher_logits_dtype.itemsize
  for bias, head_dtype in (
    (x.bias, logits_dtype),
    (x.teacher_bias, teacher_logits_dtype),
  ):
    per_logit += 0 if bias is None else _plan.bias_bytes(head_dtype)
  per_logit += kernel.work_bytes
  if not kernel.in_place(
    *_chunk_heads(vocab, logits_dtype, teacher_logits_dtype), dtype
  ):
    per_logit += np.dtype(dtype).itemsize
  chunk = perf.chunk_size and min(perf.chunk_size, n_rows)
  chunk = chunk or _plan.rows_in_budget(n_rows, per_logit * vocab, budget)
  # Rows appended only where one chunk holds all rows: it holds them too.
  appended = _plan.tma_row_padding(n_rows, (chunk,), gemm, dtype)
  chunk += appended
  # As linear_cross_entropy's: in place for a few chunks, else float32.
  accum = perf.accum_dtype or _plan.default_accum_dtype(n_rows, chunk, x.weight.dtype)
  bias_dtype = x.weight.dtype if x.bias is None else x.bias.dtype
  width = matmul.vocab_size(x.weight, layout)
  plan = Plan(
    options=options,
    weight_layout=layout,
    rows_per_chunk=chunk,
    logits_dtype=logits_dtype,
    teacher_logits_dtype=teacher_logits_dtype,
    dweight_dtype=np.dtype(accum or x.weight.dtype),
    dbias_dtype=np.dtype(accum or at_least_float32(bias_dtype)),
    matmul_tile=_plan.matmul_tile(
      platform, width, max(x.hidden.shape[1], x.teacher_hidden.shape[1]), budget
    ),
    gemm=gemm,
    kernel=kernel,
    pad_logits=pad,
  )
  return Planned(plan, x, appended)


def transposes_weights(x: Heads, layout: str, kernel, gemm: str, dtypes) -> bool:
  """Whether the sweep runs faster on both heads' ``[D, V]`` weights given
  transposed (a copy of each per step): where the Mosaic GEMM would pad the
  logits of ``[V, D]`` weights of this vocabulary, but TMA cannot copy the
  rows of ``[D, V]`` ones (V not whole 64-column tiles: GPT-2's 50257), which
  leaves the sweep to XLA's GEMMs and the fallback kernel."""
  if layout != "dv" or _pads_logits(x, layout, kernel, gemm, *dtypes):
    return False
  flip = lambda w: jax.ShapeDtypeStruct(w.shape[::-1], w.dtype)
  flipped = x._replace(weight=flip(x.weight), teacher_weight=flip(x.teacher_weight))
  return _pads_logits(flipped, "vd", kernel, gemm, *dtypes)


def transposed(x: Heads, layout: str, kernel, gemm: str, dtypes, budget: int):
  """``(heads, "vd", budget)``: both heads with their ``[D, V]`` weights
  transposed and the budget left to plan the rows with, where
  ``transposes_weights`` and the copies (both weights' and the student's
  gradient's) take at most half the memory budget; else None."""
  if not transposes_weights(x, layout, kernel, gemm, dtypes):
    return None
  nbytes = lambda w: w.size * np.dtype(w.dtype).itemsize
  copies = 2 * nbytes(x.weight) + nbytes(x.teacher_weight)
  if copies > budget // 2:
    return None
  flipped = x._replace(weight=x.weight.T, teacher_weight=x.teacher_weight.T)
  return flipped, "vd", budget - copies


def _pads_logits(x: Heads, layout: str, kernel, gemm: str, *dtypes) -> bool:
  """Whether the chunks' logits come padded to whole 64-column tiles: a
  vocabulary of other widths (GPT-2's 50257), both heads' logits (biases
  added) by the Mosaic GEMM, in ``dtypes`` (the heads' logits', the
  gradients') that ``kernel`` takes whole (``pads_logits``)."""
  vocab = matmul.vocab_size(x.weight, layout)
  if gemm != "mosaic" or not kernel.pads_logits(*dtypes):
    return False
  if matmul.padded_width(vocab) == vocab:
    return False
  heads = (
    (x.hidden, x.weight, x.bias, dtypes[0]),
    (x.teacher_hidden, x.teacher_weight, x.teacher_bias, dtypes[1]),
  )
  for hidden, weight, bias, dtype in heads:
    rows = jax.ShapeDtypeStruct((_plan.TMA_ROWS, hidden.shape[1]), hidden.dtype)
    if not matmul.mosaic_takes_logits(rows, weight, layout, dtype, bias=bias):
      return False
  return True
