"""The public entry point: ``linear_cross_entropy`` validates, resolves, dispatches.

``resolve`` is the one place where the options' defaults are decided (the
backend, the logits and accumulator dtypes, the chunk plan, the loop order and
the gradient mode); below it every value is concrete.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax

from mst_jax import _kernels, _plan
from mst_jax._args import inputs as _inputs
from mst_jax._args import options as _options
from mst_jax._args.inputs import Rows
from mst_jax._args.options import LossOptions, PerfOptions
from mst_jax._math import full_logits
from mst_jax._math.ce import at_least_float32
from mst_jax._sweep import mesh as _mesh
from mst_jax._sweep.driver import Plan, reduced_loss, row_losses
from mst_jax._sweep.row_chunks import RowChunks
from mst_jax._sweep.rows import SweepConfig, stat_dtype
from mst_jax._sweep.vocab_blocks import VocabBlocks

DEFAULT_MEMORY_BUDGET = _plan.DEFAULT_MEMORY_BUDGET
_MESH_ARGNAMES = ("mesh", "batch_axis", "vocab_axis")
STATIC_ARGNAMES = (
  *_options.OPTION_NAMES,
  "weight_layout",
  "return_aux",
  *_MESH_ARGNAMES,
)


@_options.public_jit(STATIC_ARGNAMES, per_row_scale=True)
def linear_cross_entropy(
  hidden: jax.Array,
  weight: jax.Array,
  labels: jax.Array,
  bias: jax.Array | None = None,
  *,
  where: jax.Array | None = None,
  token_weights: jax.Array | None = None,
  class_weights: jax.Array | None = None,
  ignore_index: int = -100,
  reduction: str = "mean",
  label_smoothing: float = 0.0,
  z_loss: float = 0.0,
  logit_softcap: float | None = None,
  logit_scale: float | None = None,
  shift: bool = False,
  weight_layout: str = "vd",
  chunk_size: int | None = None,
  memory_budget: int | None = None,
  vocab_block_size: int | None = None,
  impl: str | None = None,
  accum_dtype: jax.typing.DTypeLike | None = None,
  logits_dtype: jax.typing.DTypeLike | None = None,
  grad_mode: str | None = None,
  return_aux: bool = False,
  mesh: jax.sharding.Mesh | None = None,
  batch_axis: str | None = None,
  vocab_axis: str | None = None,
):
  r"""Cross-entropy of ``hidden @ weight.T (+ bias)`` without the full logits.

  For each token with logits ``z = hidden @ weight.T + bias`` (``[V]``, float32
  accumulation, stored in ``logits_dtype``) and label ``y``::

    s    = c * tanh(a * z / c)   (c = logit_softcap, a = logit_scale; s = a * z
                                  without a softcap, a = 1 without a scale)
    lse  = logsumexp(s)
    loss = (1 - eps) * (lse - s[y]) + eps * (lse - mean(s)) + z_loss * lse**2

  with ``eps = label_smoothing`` (the torch / optax definition). The loss is
  computed in row chunks: at most ``chunk_size x V`` logits exist at a time,
  never ``N x V`` (docs/architecture.md has the design).

  Args:
    hidden: ``[N, D]`` or ``[..., T, D]`` float (float32, bfloat16, float16 or
      float64).
    weight: ``[V, D]`` (``weight_layout="vd"``: an embedding table or a torch
      ``lm_head.weight``) or ``[D, V]`` (``"dv"``: a Flax Dense kernel).
    labels: integer, ``hidden.shape[:-1]``.
    bias: optional ``[V]`` float.
    where: optional bool, shape of ``labels``; False excludes a token (on top
      of ``ignore_index``). With ``shift``, it refers to label positions.
    token_weights: optional float, shape of ``labels``: each valid token's
      loss (its z-loss term included) is multiplied by its weight, and
      ``reduction="mean"`` divides by the sum of the valid tokens' weights
      (0.0 when that is 0). Data: not differentiated. With ``shift``, it
      refers to label positions.
    class_weights: optional float ``[V]``, ``torch.nn.functional.cross_entropy``'s
      ``weight``: a valid token's loss is ``(1 - eps) * w[y] * (lse - s[y]) +
      (eps / V) * sum_c w[c] * (lse - s[c])`` (plus its z-loss term,
      unweighted), and ``reduction="mean"`` divides by the sum of ``w[y]``
      (times the token weights) over valid tokens. Non-negative data, not
      differentiated; with smoothing not for ``impl="pallas"`` (it raises).
    ignore_index: label value that excludes a token.
    reduction: ``"mean"`` over valid tokens (exactly 0.0 when none is valid),
      ``"sum"``, or ``"none"`` (per token, shape of ``labels``, 0 at excluded
      tokens).
    label_smoothing: ``eps`` in ``[0, 1]``.
    z_loss: adds ``z_loss * lse**2`` per valid token (PaLM).
    logit_softcap: ``c > 0``: logits become ``c * tanh(logits / c)`` (Gemma 2).
    logit_scale: ``a > 0``: logits become ``a * (hidden @ weight.T + bias)``
      before the softcap (Cohere's ``logit_scale``; Granite's is
      ``1 / logits_scaling``; a sampling temperature ``T`` is ``1 / T``).
      Also an array broadcastable to ``hidden.shape[:-1]`` (a temperature a
      sequence or a token), traced under ``jit`` and differentiable; it
      scales ``hidden`` (rounded to its dtype) and takes no bias.
    shift: if True, position ``t`` predicts ``labels[..., t + 1]`` along the
      token axis (unshifted Hugging Face style labels); the last position of
      each sequence is excluded. ``hidden`` is not sliced or copied, and
      per-token outputs keep the shape of ``labels``.
    weight_layout: ``"vd"`` or ``"dv"``, see ``weight``.
    chunk_size: rows per chunk (their logits exist at once; the ``dhidden`` /
      ``dweight`` matmuls also run per chunk). None plans chunks (and, for
      float32 logits, groups of chunks) from ``memory_budget``.
    memory_budget: a cap on the step's temporaries, in bytes per device
      (default 2.25 GiB, ``DEFAULT_MEMORY_BUDGET``, divided by the
      ``vocab_axis`` size): the row chunks, groups and ``dweight``
      accumulator are planned to fit it.
    vocab_block_size: the low-memory loop order (vocabulary blocks):
      each row chunk walks the vocabulary in blocks of this many columns,
      once for the statistics and once for the gradients, so only
      ``[rows, vocab_block_size]`` logits exist and nothing grows with V.
      Costs 8 N·D·V FLOPs (the logits are formed twice) and one in-place pass
      over ``dweight`` per row chunk; rows are not compacted. Rows per chunk
      come from ``chunk_size`` or ``memory_budget``
      (the default budget is not divided
      over vocab shards here: a row's cost does not depend on V), and
      ``dweight`` accumulates in the weight's dtype unless ``accum_dtype``
      says otherwise. Multiples of 128 suit tensor cores; V need not be a
      multiple. None (default): whole-row chunks.
    impl: None (automatic: ``"mosaic"`` on a Hopper GPU, ``"pallas"`` on
      other GPUs, ``"xla"`` elsewhere), ``"xla"`` (chunked, per-chunk math
      and matmuls in XLA), ``"pallas"`` (chunked, per-chunk math in Pallas
      Triton kernels and XLA's matmuls; on a CPU the kernels run in
      interpret mode, slowly: for tests), ``"mosaic"`` (on a Hopper GPU the
      matmuls and the per-chunk cross-entropy as Mosaic GPU kernels, the
      statistics in the logits matmul's epilogue, where the arrays are whole
      TMA tiles, XLA's per-chunk math and matmuls for other shapes; not
      autotuned, so the first call peaks like later ones; elsewhere as
      ``"pallas"``, with one warning) or ``"reference"`` (full logits; for
      tests and small problems). If the Pallas Triton lowering is
      unavailable, ``"pallas"`` falls back to ``"xla"`` with one warning.
    accum_dtype: the dtype ``dweight`` and ``dbias`` are summed in across
      row groups. None (default): float32 where its ``[V, D]`` buffer fits in
      half of ``memory_budget`` and there are more than 2 groups (float16
      weights: always), else the weight's dtype in place, one rounding per
      group (docs/how_it_works.md). With ``vocab_block_size``, in place
      unless given here.
    logits_dtype: the dtype the logits matmul writes (it accumulates in
      float32 either way; the cross-entropy math is float32). None (default):
      bfloat16 for bfloat16 inputs, as a bfloat16 ``Dense`` head feeding a
      float32 loss has (the same gradient error as that full-logits version,
      with half the logits traffic, and each chunk's ``dlogits`` overwrite its
      logits in place); otherwise at least float32. ``jnp.float32`` keeps
      float32 logits for bfloat16 inputs: a loss exact to float32 rounding,
      for about 8% more time at the Llama-3 head (docs/benchmarks.md).
    grad_mode: how gradients are formed. ``"fused"``: during the forward sweep,
      in the same pass as the loss (6 N·D·V FLOPs, like full-logits autodiff;
      needs a scalar ``reduction``; ``aux.lse`` is then not differentiable).
      ``"recompute"``: the backward recomputes each chunk's logits (8 N·D·V
      FLOPs; every reduction; differentiable ``aux.lse``). None: ``"fused"``
      for ``"mean"`` / ``"sum"`` when each device holds at least D rows,
      else ``"recompute"`` (the fused mode's residual is a whole
      ``dweight``, which a differentiated ``lax.scan`` over micro-batches
      would keep one of per step).
    return_aux: if True, also return a ``LossAux``.
    mesh: a ``jax.sharding.Mesh`` to compute over: rows
      split over ``batch_axis`` (data parallel; ``dweight`` summed over it) and
      the vocabulary over ``vocab_axis`` (vocab parallel: each device holds
      ``V / m`` rows of the weight, statistics are combined across the axis,
      no weight all-gather, ``dweight`` stays sharded). N must split evenly
      over ``batch_axis`` and V over ``vocab_axis``. Without a mesh, inputs
      sharded under ``jax.jit`` also work (XLA's GSPMD partitions the chunked
      computation), just not as well.
    batch_axis: mesh axis of the rows, or None.
    vocab_axis: mesh axis of the vocabulary, or None.

  Returns:
    The loss, float32 (float64 for float64 inputs): a scalar, or the shape of
    ``labels`` for ``reduction="none"``; with ``return_aux``, ``(loss, aux)``.
    Gradients come back in each input's own dtype.

    A valid token whose label is outside ``[0, V)`` has a NaN loss and NaN
    gradients: such a label is an error and is never read as a valid class.

  Raises:
    ValueError: mismatched shapes (``token_weights`` included), an unknown
      ``reduction`` / ``weight_layout`` / ``impl`` / ``grad_mode``, or option
      values out of range (``logit_scale <= 0``, say).
    TypeError: non-integer labels, non-float hidden / weight / bias /
      ``token_weights``, a non-bool ``where``, or options of the wrong type.
    NotImplementedError: ``grad_mode="fused"`` with ``reduction="none"``.

  Example:

    >>> import jax, jax.numpy as jnp
    >>> import mst_jax
    >>> k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    >>> hidden = jax.random.normal(k1, (2, 16, 64), jnp.bfloat16)
    >>> weight = jax.random.normal(k2, (1000, 64), jnp.bfloat16) * 0.05
    >>> labels = jax.random.randint(k3, (2, 16), 0, 1000)
    >>> loss, grads = jax.value_and_grad(
    ...     mst_jax.linear_cross_entropy, argnums=(0, 1))(hidden, weight, labels)
    >>> loss.dtype, grads[1].dtype
    (dtype('float32'), dtype(bfloat16))
  """
  options, perf = _options.from_arguments(locals())
  if not isinstance(return_aux, bool):
    raise TypeError(f"return_aux must be a bool, got {return_aux!r}.")
  rows = _inputs.prepare(
    hidden,
    weight,
    labels,
    bias,
    where,
    options,
    weight_layout,
    token_weights,
    class_weights,
  )
  layout = _mesh.layout_for(mesh, batch_axis, vocab_axis, weight_layout, rows)
  weights = _inputs.row_weights(rows, options.reduction, stat_dtype(rows.hidden))
  loss, lse, correct, _ = per_row_outputs(
    rows, options, perf, weight_layout, layout, weights
  )
  return _inputs.finalize(
    rows, loss, lse, correct, weights=weights, options=options, return_aux=return_aux
  )


def per_row_outputs(
  rows, options, perf, weight_layout, layout, weights, *, entropy=False
):
  """Per-row ``(loss, lse, correct, entropy)`` (the loss reduced with
  ``weights`` already when the gradient is formed in the forward), then the
  logits at ``rows.ids`` (``[N, K]``) when the rows have ids."""
  n_rows, perf = rows.hidden.shape[0], _options.for_manual_axes(perf, rows.hidden)
  if perf.impl == "reference" or n_rows == 0:
    if layout is not None and n_rows:
      if not layout.from_inputs:
        raise ValueError("impl='reference' forms the full logits; it takes no mesh.")
      rows = _mesh.gathered(rows)
    ce = dataclasses.replace(options.ce, entropy=entropy)
    return full_logits.row_losses(*rows.arrays, options=ce, weight_layout=weight_layout)
  rows = rows.for_chunks(options.label_smoothing)
  planned = resolve(rows, options, perf, weight_layout, layout, entropy=entropy)
  rows, plan, pad = planned.rows, planned.plan, planned.pad
  devices = _mesh.row_devices(layout)
  if pad:
    weights = _inputs.append_rows(weights, pad, groups=devices)
  if not planned.fused:
    outputs = row_losses(plan, *rows.arrays)
  else:
    outputs = reduced_loss(plan, weights, *rows.arrays)
  if not pad:
    return outputs
  drop = lambda x: _inputs.drop_appended(x, pad, groups=devices)
  return tuple(x if x.ndim == 0 else drop(x) for x in outputs)


class Planned(NamedTuple):
  """One call's plan and the rows it runs on.

  ``rows``: the given rows, with the weight transposed where the plan's
  backend runs faster on ``[V, D]`` (outside the custom VJPs: autodiff
  transposes ``dweight`` back) and ``pad`` rows appended to each device's
  where the Mosaic GPU kernels need whole tiles. ``fused``: the gradient is
  formed in the forward pass.
  """

  plan: Plan
  fused: bool
  rows: Rows
  pad: int


def resolve(
  rows: Rows,
  options: LossOptions,
  perf: PerfOptions,
  weight_layout: str,
  layout: _mesh.Layout | None,
  *,
  entropy: bool = False,
) -> Planned:
  """Every default decided once (``entropy``: the per-row entropy too): the
  kernels, the weight's layout, the loop order and its accumulators, the
  rows appended, the gradient mode."""
  n_rows, devices = rows.hidden.shape[0], _mesh.row_devices(layout)
  vocab_devices = 1 if layout is None else layout.axis_size(layout.vocab_axis)
  logits_dtype = _options.resolve_logits_dtype(perf.logits_dtype, rows.hidden.dtype)
  platform = _platform(layout)
  backend = _kernels.select(
    perf.impl, platform, not_on_triton=_not_on_triton(rows.class_weights)
  )
  head = _kernels.HeadSpec(
    weight_layout,
    logits_dtype,
    dataclasses.replace(options.ce, entropy=entropy),
    rows.vocab_size,
    matmul_tile=_plan.matmul_tile(
      platform,
      rows.vocab_size // vocab_devices,
      rows.hidden.shape[1],
      _budget(perf, vocab_devices),
    ),
    gemm=_kernels.select_gemm(perf.impl, platform),
  )
  if (transposed := _transposed_perf(rows, backend, head, perf, layout)) is not None:
    rows, perf = rows._replace(weight=rows.weight.T), transposed
    head = dataclasses.replace(head, weight_layout="vd")
    layout = layout and dataclasses.replace(layout, weight_layout="vd")
  cpu = platform == "cpu"
  # XLA's cross-entropy off the CPU writes a group's dlogits beside its logits.
  apart = isinstance(backend, _kernels.XlaChunkCE) and not cpu
  order, accum = _loop_order(
    rows, perf, logits_dtype, layout, cpu=cpu, gemm=head.gemm, dlogits_apart=apart
  )
  pad = _plan.tma_row_padding(
    n_rows // devices, _blocks(order), head.gemm, rows.hidden.dtype
  )
  if pad:
    rows = _inputs.with_rows_appended(rows, pad, groups=devices)
    order = _appended(order, n_rows // devices, pad)
  bias_dtype = rows.weight.dtype if rows.bias is None else rows.bias.dtype
  config = SweepConfig(
    backend=backend,
    head=head,
    dweight_dtype=accum or rows.weight.dtype,
    dbias_dtype=accum or at_least_float32(bias_dtype),
  )
  if layout is not None:
    if layout.vocab_axis is not None:
      shard_size = rows.vocab_size // layout.axis_size(layout.vocab_axis)
      shard = _mesh.VocabShard(layout.vocab_axis, shard_size, rows.vocab_size)
      config = dataclasses.replace(config, columns=shard)
    order = _mesh.Sharded(order, layout)
  mode = _grad_mode(n_rows, rows, options, perf, layout)
  keep = mode == "keep" and _one_group_in_place(rows, order, logits_dtype, layout)
  return Planned(Plan(config, order, keep_logits=keep), mode == "fused", rows, pad)


def _transposed_perf(rows: Rows, backend, head, perf: PerfOptions, layout):
  """The ``perf`` to plan a ``[D, V]`` weight's transpose with, where
  ``backend`` runs faster on it (``transposes_weight``), else None.

  The transposed copy and its gradient (``2 V D`` elements a device) come
  out of the memory budget; where they would take more than half of it,
  the weight stays as it is.
  """
  if head.weight_layout != "dv":
    return None
  vocab_devices = 1 if layout is None else layout.axis_size(layout.vocab_axis)
  shape = (rows.hidden.shape[1], rows.vocab_size // vocab_devices)
  weight = jax.ShapeDtypeStruct(shape, rows.weight.dtype)
  x = _kernels.ChunkInputs(rows.hidden, weight, rows.bias, rows.labels)
  x = x._replace(class_weights=rows.class_weights)
  copies = 2 * math.prod(shape) * weight.dtype.itemsize
  budget = _budget(perf, vocab_devices)
  if copies > budget // 2 or not backend.transposes_weight(x, head):
    return None
  if perf.chunk_size is not None:  # the rows are given, not planned
    return perf
  return dataclasses.replace(perf, memory_budget=budget - copies)


def _blocks(order) -> tuple[int, int]:
  """The row counts of the blocks ``order`` forms: its chunks and groups."""
  return (order.rows_per_chunk, getattr(order, "rows_per_group", 0))


def _appended(order, n_rows: int, count: int):
  """``order`` for ``count`` rows appended to ``n_rows``: a block that held
  all ``n_rows`` holds them all (``_plan.tma_row_padding`` appends rows only
  then)."""
  grown = lambda size: n_rows + count if size == n_rows else size
  changes = {"rows_per_chunk": grown(order.rows_per_chunk)}
  if hasattr(order, "rows_per_group"):
    changes["rows_per_group"] = grown(order.rows_per_group)
  return dataclasses.replace(order, **changes)


def _one_group_in_place(rows: Rows, order, logits_dtype, layout) -> bool:
  """Whether the planner's group holds every row of a device and ``dlogits``
  overwrite logits of their dtype: then the logits the forward keeps
  (``Plan.keep_logits``) are the buffer the recompute backward would form."""
  order = getattr(order, "inner", order)  # a mesh's: each device's
  return (
    isinstance(order, RowChunks)
    and order.rows_per_group >= rows.hidden.shape[0] // _mesh.row_devices(layout)
    and _plan.dlogits_in_place(logits_dtype, rows.hidden.dtype)
  )


def _grad_mode(
  n_rows: int, rows: Rows, options: LossOptions, perf: PerfOptions, layout
) -> str:
  """The requested mode, else: the gradient in the forward pass for a scalar
  loss; per token, "keep" (the forward's logits, where they fit as one group,
  else recompute).

  Recompute when a device holds fewer rows than D: the fused mode's residual
  is the whole ``dweight`` (V x D), more than the naive head's logits (N x V)
  then, and a ``lax.scan`` over micro-batches differentiated from outside
  stacks one per step (kept logits too: a step that small is likely one).
  """
  if perf.grad_mode is not None:
    return perf.grad_mode
  if n_rows // _mesh.row_devices(layout) < rows.hidden.shape[1]:
    return "recompute"
  return "keep" if options.reduction == "none" else "fused"


def _not_on_triton(class_weights) -> str | None:
  """What the Triton kernels do not compute here (XLA's and Mosaic's do)."""
  return None if class_weights is None else "class weights with label smoothing"


def _loop_order(
  rows: Rows,
  perf: PerfOptions,
  logits_dtype,
  layout,
  *,
  cpu: bool,
  gemm: str,
  dlogits_apart: bool = False,
):
  """``(order, accum_dtype)``: the loop order planned for the rows and the
  vocabulary one device holds, and the accumulators' dtype (None: in place).

  With the Mosaic GEMMs the row chunks are bounded (``RowChunks.bounded``):
  a block with excluded rows runs its products to its last valid row; with
  XLA's it runs whole (its excluded rows' ``dlogits`` are zero)."""
  bounded = gemm == "mosaic"
  vocab_devices = 1 if layout is None else layout.axis_size(layout.vocab_axis)
  n_rows = rows.hidden.shape[0] // _mesh.row_devices(layout)
  vocab = rows.vocab_size // vocab_devices
  dtype = rows.hidden.dtype
  chunk = perf.chunk_size and min(perf.chunk_size, n_rows)
  if perf.vocab_block_size is not None:
    block = perf.vocab_block_size
    chunk = chunk or _plan.plan_vocab_blocked_rows(
      n_rows,
      rows.hidden.shape[1],
      min(block, vocab),
      dtype,
      memory_budget=_budget(perf, vocab_devices),
    )
    # dweight stays in place: a float32 [V, D] buffer would be this order's largest.
    return VocabBlocks(chunk, block), perf.accum_dtype
  if chunk is not None:
    accum = perf.accum_dtype or _plan.default_accum_dtype(
      n_rows, chunk, rows.weight.dtype
    )
    return RowChunks(chunk, chunk, bounded=bounded), accum
  chunk, group, accum = _plan.plan_with_accumulator(
    n_rows,
    vocab,
    rows.hidden.shape[1],
    dtype,
    rows.weight.dtype,
    memory_budget=_budget(perf, vocab_devices),
    logits_dtype=logits_dtype,
    cpu=cpu,
    biased=rows.bias is not None,
    dlogits_apart=dlogits_apart,
    accum_dtype=perf.accum_dtype,
  )
  return RowChunks(chunk, group, bounded=bounded), accum


def _budget(perf: PerfOptions, vocab_devices: int) -> int:
  """A device's: ``perf``'s, else the default split over vocab shards (not blocks)."""
  if perf.memory_budget is not None:
    return perf.memory_budget
  blocks = perf.vocab_block_size is not None
  return DEFAULT_MEMORY_BUDGET // (1 if blocks else vocab_devices)


def _platform(layout: _mesh.Layout | None) -> str:
  """The platform the loss runs on: the mesh's, else JAX's default."""
  return jax.default_backend() if layout is None else layout.platform
