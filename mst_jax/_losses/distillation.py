"""``linear_distillation_loss``: a KL / JSD loss between a student and a teacher head.

The public function validates its arguments at trace time, turns both heads
into rows (``_args.inputs.prepare``) and dispatches: to the chunked sweep
(``_sweep.distill``: neither head's ``[N, V]`` logits exist) or, with
``impl="reference"``, to the full-logits oracle (``_math.full_distill``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from mst_jax import _manual_axes, _plan
from mst_jax._args import inputs as _inputs
from mst_jax._args import options as _options
from mst_jax._gemm import matmul
from mst_jax._math import full_distill
from mst_jax._math.distill import DistillOptions
from mst_jax._sweep import distill as _distill_sweep
from mst_jax._sweep import mesh as _mesh
from mst_jax._sweep.distill import Heads
from mst_jax._sweep.driver import reduced_loss, row_losses
from mst_jax._sweep.rows import stat_dtype

# The cross-entropy options that do not apply to a distillation loss.
_CE_ONLY = {"label_smoothing": 0.0, "z_loss": 0.0}
STATIC_ARGNAMES = (
  "divergence",
  "beta",
  "temperature",
  "hard_label_weight",
  "ignore_index",
  "reduction",
  "shift",
  "weight_layout",
  "logit_softcap",
  "logit_scale",
  *(f.name for f in dataclasses.fields(_options.PerfOptions)),
)

# ---- The public function. ----


@_options.public_jit(STATIC_ARGNAMES)
def linear_distillation_loss(
  student_hidden: jax.Array,
  student_weight: jax.Array,
  teacher_hidden: jax.Array,
  teacher_weight: jax.Array,
  labels: jax.Array | None = None,
  *,
  student_bias: jax.Array | None = None,
  teacher_bias: jax.Array | None = None,
  divergence: str = "forward_kl",
  beta: float = 0.5,
  temperature: float = 1.0,
  hard_label_weight: float = 0.0,
  ignore_index: int = -100,
  where: jax.Array | None = None,
  reduction: str = "mean",
  shift: bool = False,
  weight_layout: str = "vd",
  logit_softcap: float | None = None,
  logit_scale: float | None = None,
  chunk_size: int | None = None,
  memory_budget: int | None = None,
  vocab_block_size: int | None = None,
  impl: str | None = None,
  accum_dtype: jax.typing.DTypeLike | None = None,
  logits_dtype: jax.typing.DTypeLike | None = None,
  grad_mode: str | None = None,
):
  r"""Distillation loss between a student and a teacher LM head, without logits.

  For each token, with each head's scores ``s = softcap(logit_scale * (hidden
  @ weight.T + bias))`` (as in ``linear_cross_entropy``; both heads),
  ``P = softmax(s_teacher / T)`` and ``Q = softmax(s_student / T)``::

    "forward_kl":  KL(P || Q) = sum_j P_j (log P_j - log Q_j)
    "reverse_kl":  KL(Q || P)
    "jsd":         beta KL(P || M) + (1 - beta) KL(Q || M),  M = beta P + (1 - beta) Q

    loss = divergence + hard_label_weight * CE(s_student, label)

  where the cross-entropy is the student's at temperature 1. There is no
  ``T**2`` factor (multiply the loss if you want one). The loss is computed
  in row chunks: at most ``chunk x V`` logits of each head exist at a time,
  never ``N x V`` (docs/distillation.md). Gradients flow to the student's
  hidden states, weight and bias only: the teacher is not differentiated
  (its gradients are zero) and no teacher-gradient matmul is computed.

  Args:
    student_hidden: ``[N, D_s]`` or ``[..., D_s]`` float.
    student_weight: ``[V, D_s]`` (``weight_layout="vd"``) or ``[D_s, V]``
      (``"dv"``).
    teacher_hidden: ``[..., D_t]`` float, the leading shape of
      ``student_hidden``; ``D_t`` may differ from ``D_s``.
    teacher_weight: ``[V, D_t]`` or ``[D_t, V]`` (the same layout and ``V``
      as the student's).
    labels: optional integer, ``student_hidden.shape[:-1]``: tokens whose
      label is ``ignore_index`` are excluded, and the hard-label term reads
      them. Required when ``hard_label_weight > 0``.
    student_bias, teacher_bias: optional ``[V]`` float (``-inf`` bans a
      token; ban it in both heads, or the divergence may be infinite).
    divergence: ``"forward_kl"``, ``"reverse_kl"`` or ``"jsd"``.
    beta: the JSD's mixture weight, in ``(0, 1)``. The KL divergences take
      none: another value than the default raises rather than being ignored.
    temperature: ``T > 0``, finite; divides both heads' scores.
    hard_label_weight: ``h >= 0``, the weight of the student's cross-entropy
      on ``labels`` at temperature 1.
    ignore_index: label value that excludes a token.
    where: optional bool, the leading shape; False excludes a token. With
      ``shift``, it refers to label positions.
    reduction: ``"mean"`` over valid tokens (exactly 0.0 when none is
      valid), ``"sum"``, or ``"none"`` (per token, 0 at excluded tokens).
    shift: if True, position ``t`` is scored with ``labels[..., t + 1]`` and
      ``where[..., t + 1]``, and the last position of each sequence is
      excluded (as in ``linear_cross_entropy``).
    weight_layout: ``"vd"`` or ``"dv"``, for both weights.
    logit_softcap, logit_scale: as in ``linear_cross_entropy``, applied to
      both heads before the temperature.
    chunk_size: rows per chunk (both heads' logits exist for that many rows
      at once). None plans it from ``memory_budget``.
    memory_budget: bytes for a chunk's temporaries, per logit: both heads'
      logits; with the Pallas kernels, ``dlogits`` unless they overwrite the
      student's logits (the same dtype); in XLA, ``dlogits`` and two float32
      work arrays (default 2.25 GiB,
      ``mst_jax._losses.cross_entropy.DEFAULT_MEMORY_BUDGET``). Over more than
      2 chunks a float32 ``dweight`` accumulator (``4 V D_s`` bytes) comes on
      top, unless ``accum_dtype`` says otherwise.
    vocab_block_size: not supported (raises ``NotImplementedError``): use
      ``chunk_size`` or ``memory_budget`` to bound the memory.
    impl: None (chunked; on a Hopper GPU the GEMMs and each chunk's loss and
      ``dlogits`` as Mosaic GPU kernels, the Triton kernel for what those do
      not take: docs/distillation.md; on other GPUs one Pallas Triton kernel
      per chunk; elsewhere in XLA), ``"pallas"`` (the Triton kernel
      everywhere, XLA's GEMMs; interpret mode off a GPU, slow), ``"xla"``
      (the per-chunk math in XLA), ``"mosaic"`` (as None; XLA's GEMMs with
      one warning off Hopper), or
      ``"reference"`` (both heads' full logits, differentiated by autodiff;
      for tests and small problems).
    accum_dtype: the ``dweight`` / ``dbias`` accumulators' dtype. None, as
      for ``linear_cross_entropy``: ``dweight`` in the weight's dtype, in
      place, for at most 2 chunks (one rounding per chunk), else float32;
      at least float32 for ``dbias``.
    logits_dtype: the dtype both logits matmuls write (they accumulate in
      float32; the divergence math is float32). None: bfloat16 for a
      bfloat16 head, else at least float32.
    grad_mode: ``"fused"`` (gradients in the forward sweep; a scalar
      ``reduction``), ``"recompute"`` (the backward forms both heads' logits
      again; every reduction), or None: ``"fused"`` for ``"mean"`` /
      ``"sum"`` with at least ``D_s`` tokens, else ``"recompute"`` (the fused
      mode's residual is a whole ``dweight``, which a differentiated
      ``lax.scan`` over micro-batches would keep one of per step).

  Returns:
    The loss, float32 (float64 for float64 inputs): a scalar, or the leading
    shape for ``reduction="none"``. Gradients come back in each input's dtype.
    A valid token whose label is outside ``[0, V)`` has a NaN loss with
    ``hard_label_weight > 0``.

  Raises:
    ValueError: mismatched shapes (a different ``V`` or leading shape), an
      unknown ``divergence`` / ``reduction`` / ``weight_layout`` / ``impl`` /
      ``grad_mode``, ``beta`` outside ``(0, 1)`` with ``"jsd"`` (or other
      than 0.5 with a KL divergence), a
      temperature that is not finite and positive, ``hard_label_weight < 0``
      or ``> 0`` without ``labels``.
    TypeError: non-float hidden states, weights or biases, non-integer
      labels, a non-bool ``where``, or options of the wrong type.
    NotImplementedError: ``vocab_block_size``, or ``grad_mode="fused"`` with
      ``reduction="none"``.

  Example:

    >>> import jax, jax.numpy as jnp
    >>> import mst_jax
    >>> ks = jax.random.split(jax.random.key(0), 4)
    >>> student_hidden = jax.random.normal(ks[0], (2, 16, 32))
    >>> student_weight = jax.random.normal(ks[1], (1000, 32)) * 0.1
    >>> teacher_hidden = jax.random.normal(ks[2], (2, 16, 64))
    >>> teacher_weight = jax.random.normal(ks[3], (1000, 64)) * 0.1
    >>> loss, grads = jax.value_and_grad(
    ...     mst_jax.linear_distillation_loss, argnums=(0, 1))(
    ...     student_hidden, student_weight, teacher_hidden, teacher_weight)
    >>> loss.shape, grads[1].shape
    ((), (1000, 32))
  """
  options, perf = _options.from_arguments({**locals(), **_CE_ONLY})
  distill = _distill_options(divergence, beta, temperature, hard_label_weight, options)
  if distill.hard_label_weight and labels is None:
    raise ValueError(
      f"hard_label_weight={hard_label_weight!r} needs labels (the student's"
      " cross-entropy is computed on them); pass labels or hard_label_weight=0."
    )
  _check_perf(perf)
  student, teacher = _prepare_heads(
    (student_hidden, student_weight, student_bias),
    (teacher_hidden, teacher_weight, teacher_bias),
    labels,
    where,
    options,
    weight_layout,
  )
  perf = _options.for_manual_axes(perf, student.hidden)
  x = Heads(
    student.hidden,
    student.weight,
    student.bias,
    *lax.stop_gradient((teacher.hidden, teacher.weight, teacher.bias)),
    student.labels,
    student.valid,
  )
  out_dtype = stat_dtype(student.hidden)
  weights = _inputs.row_weights(student, options.reduction, out_dtype)
  n_rows = student.hidden.shape[0]
  if perf.impl == "reference" or n_rows == 0:
    loss = full_distill.row_losses(*x, options=distill, weight_layout=weight_layout)
  else:
    _plan.require_concrete(
      student.hidden, student.weight, teacher.hidden, teacher.weight
    )
    layout = _rows_layout(x, weight_layout)
    per_device = (n_rows // _mesh.row_devices(layout), student.hidden.shape[1])
    fused = _grad_mode(perf, options.reduction, per_device) == "fused"

    def chunked(x: Heads, weights):
      plan, x, pad = _distill_sweep.resolve(x, distill, perf, weight_layout)
      if pad:
        x, weights = _rows_appended(x, pad), _inputs.append_rows(weights, pad)
      if fused:
        return reduced_loss(plan, weights, *x)[0]
      return row_losses(plan, *x)[0][:n_rows]

    loss = _per_device(chunked, x, weights, fused, layout)
    if fused:
      return loss.astype(out_dtype)
  loss = loss.astype(out_dtype)
  if options.reduction == "none":
    return loss.reshape(student.batch_shape)
  return jnp.sum(loss * weights)


def _rows_appended(x: Heads, count: int) -> Heads:
  """``x`` and ``count`` more rows, as ``_args.inputs.with_rows_appended`` appends
  them (zero hidden states in both heads, a label of finite score in the
  student's, valid)."""
  append = functools.partial(_inputs.append_rows, count=count)
  return x._replace(
    hidden=append(x.hidden),
    teacher_hidden=append(x.teacher_hidden),
    labels=append(x.labels, fill=_inputs.finite_label(x.bias)),
    valid=append(x.valid, fill=True),
  )


def _rows_layout(x: Heads, weight_layout: str) -> _mesh.Layout | None:
  """The layout of inputs typed on a mesh with Explicit axes (data parallel:
  the rows split as the student's hidden states are, unless they do not
  split evenly; both weights whole on every device), else None."""
  mesh = _inputs.explicit_mesh(x.hidden, x.weight, x.teacher_hidden, x.teacher_weight)
  if mesh is None:
    return None
  layout = _mesh.Layout(mesh, _inputs.spec_entry(x.hidden, 0), None, weight_layout)
  if x.hidden.shape[0] % layout.axis_size(layout.batch_axis):
    layout = dataclasses.replace(layout, batch_axis=None)  # gathered
  return layout


def _per_device(run, x: Heads, weights, fused: bool, layout: _mesh.Layout | None):
  """``run(x, weights)``: the summed loss (``fused``) or per-row losses.

  With a ``layout`` (``_rows_layout``), each device runs ``run`` on its own
  rows and the summed loss is ``psum``-ed; ``shard_map`` sums the weight
  gradients over the devices.
  """
  if layout is None:
    return run(x, weights)
  hidden, rows, whole = layout.hidden, layout.rows, P()
  specs = Heads(hidden, whole, whole, hidden, whole, whole, rows, rows)

  def body(*arrays):
    out = run(Heads(*arrays[:-1]), arrays[-1])
    return layout.sum_over(out, layout.batch_axis) if fused else out

  out_specs = whole if fused else rows
  return layout.map_devices(body, [*x, weights], [*specs, rows], out_specs)


# ---- Validation and planning, at trace time. ----


def _distill_options(divergence, beta, temperature, hard_label_weight, options):
  """The checked ``DistillOptions`` (types here, ranges in the dataclass)."""
  if not isinstance(divergence, str):
    raise TypeError(f"divergence must be a str, got {divergence!r}.")
  return DistillOptions(
    divergence=divergence,
    beta=_options.check_finite_float("beta", beta),
    temperature=_options.check_finite_float("temperature", temperature),
    hard_label_weight=_options.check_finite_float(
      "hard_label_weight", hard_label_weight
    ),
    scores=options.ce,
  )


def _check_perf(perf: _options.PerfOptions) -> None:
  """Raises for performance options this loss does not implement."""
  if perf.vocab_block_size is not None:
    raise NotImplementedError(
      "linear_distillation_loss walks whole-vocabulary row chunks;"
      " vocab_block_size is not supported. Bound the memory with chunk_size"
      " or memory_budget instead."
    )


def _grad_mode(perf: _options.PerfOptions, reduction: str, shape) -> str:
  """The requested mode, else: the gradients in the forward for a scalar
  loss, recompute per token or where a device holds fewer rows than ``D_s``
  (``shape``: a device's ``[rows, D_s]``; the fused residual, a whole
  ``dweight``, is then more than the naive heads' logits)."""
  if perf.grad_mode is not None:
    return perf.grad_mode
  n_rows, dim = shape
  return "recompute" if reduction == "none" or n_rows < dim else "fused"


def _prepare_head(head: str, hidden, weight, bias, labels, where, options, layout):
  """``_args.inputs.prepare`` for one head, its errors naming the head."""
  try:
    return _inputs.prepare(hidden, weight, labels, bias, where, options, layout)
  except (TypeError, ValueError) as error:
    raise type(error)(f"{head} head: {error}") from None


def _prepare_heads(student, teacher, labels, where, options, layout):
  """Both heads' checked rows; the teacher's leading shape and ``V`` must be
  the student's."""
  student_hidden, student_weight, _ = student
  teacher_hidden, teacher_weight, _ = teacher
  student_hidden = jnp.asarray(student_hidden)
  teacher_hidden, teacher_weight = map(jnp.asarray, (teacher_hidden, teacher_weight))
  if labels is None:  # every token counts: fill with a label that is not ignored
    labels = jnp.full(student_hidden.shape[:-1], options.ignore_index == 0, jnp.int32)
  rows = _prepare_head(
    "student", student_hidden, *student[1:], labels, where, options, layout
  )
  if teacher_hidden.shape[:-1] != student_hidden.shape[:-1]:
    raise ValueError(
      f"teacher_hidden {teacher_hidden.shape} and student_hidden"
      f" {student_hidden.shape} must have the same leading shape (all but the"
      " hidden size)."
    )
  if teacher_weight.ndim == 2:
    vocab = teacher_weight.shape[matmul.vocab_axis(layout)]
    if vocab != rows.vocab_size:
      raise ValueError(
        f"the teacher's vocabulary ({vocab}) must equal the student's"
        f" ({rows.vocab_size}): teacher_weight {teacher_weight.shape},"
        f" student_weight {jnp.shape(student_weight)} with"
        f" weight_layout={layout!r}."
      )
  teacher_rows = _prepare_head(
    "teacher", teacher_hidden, *teacher[1:], labels, where, options, layout
  )
  return _manual_axes.common((rows, teacher_rows))  # inside a caller's shard_map
