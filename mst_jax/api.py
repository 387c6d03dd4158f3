"""The public entry point: ``linear_cross_entropy``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mst_jax import backends, ce_math, chunked, config, inputs, reference, sharded

IMPLEMENTATIONS = (None, "xla", "pallas", "reference")
GRAD_MODES = (None, "fused", "recompute")


def _default_grad_mode(reduction: str) -> str:
  """Gradient in the forward for a scalar loss, recompute for per-token ones."""
  return "recompute" if reduction == "none" else "fused"


def _resolve_backend(impl: str | None, mesh) -> backends.ChunkCE | None:
  """The per-chunk backend for ``impl``; None means the full-logits reference."""
  if impl == "reference":
    return None
  platform = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
  return backends.select(impl, platform)


def _axis_size(mesh, axis: str | None) -> int:
  return 1 if axis is None else mesh.shape[axis]


def _mesh_layout(mesh, batch_axis, vocab_axis, weight_layout, rows):
  """The ``sharded.Layout`` for a mesh (None without one), after checks."""
  if mesh is None:
    if (batch_axis, vocab_axis) != (None, None):
      raise ValueError("batch_axis and vocab_axis name axes of a mesh: pass mesh=.")
    return None
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
  if batch_axis is None and vocab_axis is None:
    raise ValueError("with a mesh, give batch_axis, vocab_axis or both.")
  if batch_axis is not None and batch_axis == vocab_axis:
    raise ValueError(f"batch_axis and vocab_axis must differ, both are {batch_axis!r}.")
  for name, axis in (("batch_axis", batch_axis), ("vocab_axis", vocab_axis)):
    if axis is not None and axis not in mesh.axis_names:
      raise ValueError(f"{name}={axis!r} is not an axis of the mesh {mesh.axis_names}.")
  n_rows, vocab = rows.hidden.shape[0], rows.vocab_size
  if n_rows % _axis_size(mesh, batch_axis):
    raise ValueError(
      f"the {n_rows} tokens must split evenly over batch_axis={batch_axis!r}"
      f" ({_axis_size(mesh, batch_axis)} devices)."
    )
  if vocab % _axis_size(mesh, vocab_axis):
    raise ValueError(
      f"the vocabulary ({vocab}) must split evenly over vocab_axis={vocab_axis!r}"
      f" ({_axis_size(mesh, vocab_axis)} devices): pad the weight (and bias) to a"
      " multiple with rows whose logits never win, e.g. a bias of -1e9."
    )
  return sharded.Layout(mesh, batch_axis, vocab_axis, weight_layout)


@jax.jit(
  static_argnames=(
    "ignore_index",
    "reduction",
    "label_smoothing",
    "z_loss",
    "logit_softcap",
    "shift",
    "weight_layout",
    "chunk_size",
    "memory_budget",
    "vocab_block_size",
    "impl",
    "accum_dtype",
    "logits_dtype",
    "grad_mode",
    "return_aux",
    "mesh",
    "batch_axis",
    "vocab_axis",
  )
)
def linear_cross_entropy(
  hidden: jax.Array,
  weight: jax.Array,
  labels: jax.Array,
  bias: jax.Array | None = None,
  *,
  where: jax.Array | None = None,
  ignore_index: int = -100,
  reduction: str = "mean",
  label_smoothing: float = 0.0,
  z_loss: float = 0.0,
  logit_softcap: float | None = None,
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

    s    = logit_softcap * tanh(z / logit_softcap)   (s = z if no softcap)
    lse  = logsumexp(s)
    loss = (1 - eps) * (lse - s[y]) + eps * (lse - mean(s)) + z_loss * lse**2

  with ``eps = label_smoothing`` (the torch / optax definition). The loss is
  computed in row chunks: at most ``chunk_size x V`` logits exist at a time,
  never ``N x V``; the backward recomputes each chunk's logits.

  Args:
    hidden: ``[N, D]`` or ``[..., T, D]`` float (float32, bfloat16, float16 or
      float64).
    weight: ``[V, D]`` (``weight_layout="vd"``: an embedding table or a torch
      ``lm_head.weight``) or ``[D, V]`` (``"dv"``: a Flax Dense kernel).
    labels: integer, ``hidden.shape[:-1]``.
    bias: optional ``[V]`` float.
    where: optional bool, shape of ``labels``; False excludes a token (on top
      of ``ignore_index``).
    ignore_index: label value that excludes a token.
    reduction: ``"mean"`` over valid tokens (exactly 0.0 when none is valid),
      ``"sum"``, or ``"none"`` (per token, shape of ``labels``, 0 at excluded
      tokens).
    label_smoothing: ``eps`` in ``[0, 1]``.
    z_loss: adds ``z_loss * lse**2`` per valid token (PaLM).
    logit_softcap: ``c > 0``: logits become ``c * tanh(logits / c)`` (Gemma 2).
    shift: if True, position ``t`` predicts ``labels[..., t + 1]`` along the
      token axis (unshifted Hugging Face style labels); the last position of
      each sequence is excluded. ``hidden`` is not sliced or copied, and
      per-token outputs keep the shape of ``labels``.
    weight_layout: ``"vd"`` or ``"dv"``, see ``weight``.
    chunk_size: rows per chunk (their logits exist at once; the ``dhidden`` /
      ``dweight`` matmuls also run per chunk). None plans chunks (and, for
      float32 logits, groups of chunks) from ``memory_budget``.
    memory_budget: bytes for the chunk temporaries (default 2 GiB,
      ``config.DEFAULT_MEMORY_BUDGET``; ``config.plan_chunks``): with logits in
      the compute dtype, one chunk's logits, overwritten in place by its
      ``dlogits``; with float32 logits, one chunk's logits and one group's
      ``dlogits``, whose matmuls run once per group. Peak extra memory is about
      this plus ``dhidden``-sized buffers. It is per device; with
      ``vocab_axis`` the default is divided by that axis's size (each device
      holds that fraction of the vocabulary).
    vocab_block_size: the low-memory loop order (``mst_jax.vocab_blocked``):
      each row chunk walks the vocabulary in blocks of this many columns,
      once for the statistics and once for the gradients, so only
      ``[rows, vocab_block_size]`` logits exist and nothing grows with V.
      Costs 8 N·D·V FLOPs (the logits are formed twice) and one in-place pass
      over ``dweight`` per row chunk; rows are not compacted. Rows per chunk
      come from ``chunk_size`` or ``memory_budget``
      (``config.plan_vocab_blocked_rows``; the default budget is not divided
      over vocab shards here: a row's cost does not depend on V), and
      ``dweight`` accumulates in the weight's dtype unless ``accum_dtype``
      says otherwise. Multiples of 128 suit tensor cores; V need not be a
      multiple. None (default): whole-row chunks.
    impl: None (automatic: ``"pallas"`` on a GPU, ``"xla"`` elsewhere),
      ``"xla"`` (chunked, per-chunk math in XLA), ``"pallas"`` (chunked,
      per-chunk math in Pallas kernels; on a CPU they run in interpret mode,
      slowly: for tests) or ``"reference"`` (full logits; for tests and small
      problems). If the Pallas Triton lowering is unavailable, ``"pallas"``
      falls back to ``"xla"`` with one warning.
    accum_dtype: dtype of the ``dweight`` / ``dbias`` accumulators across
      groups. None (default): with at most 8 groups, ``dweight`` accumulates
      in the weight's dtype, in place in its output, one rounding per group
      (on the H200 at the Llama-3 head, 2 groups, its error measured 1.06x
      that of full-logits autodiff); with more, in float32, whose ``V x D``
      buffer and traffic cost less than the error of many roundings would.
      With ``vocab_block_size``, always in the weight's dtype.
    logits_dtype: the dtype the logits matmul writes (it accumulates in
      float32 either way; the cross-entropy math is float32). None (default):
      bfloat16 for bfloat16 inputs, as a bfloat16 ``Dense`` head feeding a
      float32 loss has (the same gradient error as that full-logits version,
      with half the logits traffic, and each chunk's ``dlogits`` overwrite its
      logits in place); otherwise at least float32. ``jnp.float32`` keeps
      float32 logits for bfloat16 inputs: a loss exact to float32 rounding,
      for about 8% more time at the Llama-3 head (docs/benchmarks.md, run 13).
    grad_mode: how gradients are formed. ``"fused"``: during the forward sweep,
      in the same pass as the loss (6 N·D·V FLOPs, like full-logits autodiff;
      needs a scalar ``reduction``; ``aux.lse`` is then not differentiable).
      ``"recompute"``: the backward recomputes each chunk's logits (8 N·D·V
      FLOPs; every reduction; differentiable ``aux.lse``). None: ``"fused"``
      for ``"mean"`` / ``"sum"``, ``"recompute"`` for ``"none"``.
    return_aux: if True, also return a ``LossAux``.
    mesh: a ``jax.sharding.Mesh`` to compute over (``mst_jax.sharded``): rows
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
    ValueError: mismatched shapes, an unknown ``reduction`` /
      ``weight_layout`` / ``impl``, or option values out of range.
    TypeError: non-integer labels, non-float hidden / weight / bias, a
      non-bool ``where``, or options of the wrong type.

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
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"impl must be one of {IMPLEMENTATIONS}, got {impl!r}.")
  if not isinstance(return_aux, bool):
    raise TypeError(f"return_aux must be a bool, got {return_aux!r}.")
  options = ce_math.CEOptions(
    label_smoothing=inputs.check_finite_float("label_smoothing", label_smoothing),
    z_loss=inputs.check_finite_float("z_loss", z_loss),
    logit_softcap=(
      None
      if logit_softcap is None
      else inputs.check_finite_float("logit_softcap", logit_softcap)
    ),
  )
  if chunk_size is not None:
    chunk_size = inputs.check_int("chunk_size", chunk_size, minimum=1)
  if memory_budget is not None:
    memory_budget = inputs.check_int("memory_budget", memory_budget, minimum=1)
    if chunk_size is not None:
      raise ValueError("give chunk_size or memory_budget, not both.")
  if vocab_block_size is not None:
    vocab_block_size = inputs.check_int("vocab_block_size", vocab_block_size, minimum=1)
  accum_dtype = inputs.as_dtype("accum_dtype", accum_dtype)
  logits_dtype = inputs.as_dtype("logits_dtype", logits_dtype)
  if grad_mode not in GRAD_MODES:
    raise ValueError(f"grad_mode must be one of {GRAD_MODES}, got {grad_mode!r}.")
  chunked_only = (
    chunk_size,
    memory_budget,
    vocab_block_size,
    accum_dtype,
    logits_dtype,
    grad_mode,
  )
  if impl == "reference" and chunked_only != (None,) * len(chunked_only):
    raise ValueError(
      "chunk_size, memory_budget, vocab_block_size, accum_dtype, logits_dtype"
      " and grad_mode apply to the chunked implementations, not"
      " impl='reference' (which forms the full logits)."
    )
  if grad_mode == "fused" and reduction == "none":
    raise NotImplementedError(
      "grad_mode='fused' forms the gradient of a scalar loss during the forward"
      " pass; reduction='none' needs grad_mode='recompute' (or None)."
    )
  rows = inputs.prepare(
    hidden,
    weight,
    labels,
    bias,
    where,
    ignore_index=ignore_index,
    shift=shift,
    weight_layout=weight_layout,
    reduction=reduction,
  )

  n_rows = rows.hidden.shape[0]
  layout = _mesh_layout(mesh, batch_axis, vocab_axis, weight_layout, rows)
  backend = _resolve_backend(impl, mesh)
  if backend is None or n_rows == 0:
    if layout is not None and n_rows:
      raise ValueError("impl='reference' forms the full logits; it takes no mesh.")
    outputs = reference.row_losses(
      rows.hidden,
      rows.weight,
      rows.bias,
      rows.labels,
      rows.valid,
      options=options,
      weight_layout=weight_layout,
    )
  else:
    if logits_dtype is None and rows.hidden.dtype == jnp.bfloat16:
      logits_dtype = rows.hidden.dtype
    widest = jnp.promote_types(rows.hidden.dtype, jnp.float32)
    if logits_dtype is not None and logits_dtype.itemsize > widest.itemsize:
      raise ValueError(
        f"logits_dtype={logits_dtype} is wider than the {widest} the loss is"
        f" computed in for {rows.hidden.dtype} inputs; pass float64 inputs for"
        " float64 logits."
      )
    # Chunks are planned for the rows and vocabulary one device holds.
    local_rows = n_rows // _axis_size(mesh, batch_axis)
    local_vocab = rows.vocab_size // _axis_size(mesh, vocab_axis)
    if vocab_block_size is not None and chunk_size is None:
      chunk = group = config.plan_vocab_blocked_rows(
        local_rows,
        rows.hidden.shape[1],
        min(vocab_block_size, local_vocab),
        rows.hidden.dtype,
        memory_budget=memory_budget or config.DEFAULT_MEMORY_BUDGET,
      )
    elif chunk_size is None:
      chunk, group = config.plan_chunks(
        local_rows,
        local_vocab,
        rows.hidden.dtype,
        # The default budget is the whole head's: vocab shards split it, so
        # each device plans the row chunks one device would use.
        memory_budget=memory_budget
        or config.DEFAULT_MEMORY_BUDGET // _axis_size(mesh, vocab_axis),
        logits_dtype=logits_dtype or jnp.promote_types(rows.hidden.dtype, jnp.float32),
      )
    else:
      chunk = group = min(chunk_size, local_rows)
    driver = chunked.DriverConfig(
      rows_per_chunk=chunk,
      rows_per_group=group,
      weight_layout=weight_layout,
      # The low-memory order keeps dweight in place (a float32 [V, D] buffer
      # would be its largest); the row-chunked one switches past 8 groups.
      accum_dtype=accum_dtype
      or (
        None
        if vocab_block_size is not None
        else config.default_accum_dtype(local_rows, group, rows.weight.dtype)
      ),
      options=options,
      backend=backend,
      vocab_total=rows.vocab_size,
      vocab_block=vocab_block_size,
      logits_dtype=logits_dtype,
    )
    plan = chunked.plan_for(driver)
    if layout is not None:
      plan = sharded.plan_for(plan, layout)
    args = (plan, rows.hidden, rows.weight, rows.bias, rows.labels, rows.valid)
    if (grad_mode or _default_grad_mode(reduction)) == "fused":
      weights = inputs.row_weights(
        rows, reduction, jnp.promote_types(rows.hidden.dtype, jnp.float32)
      )
      outputs = chunked.reduced_loss(*args, weights)
    else:
      outputs = chunked.row_losses(*args)
  return inputs.finalize(
    rows,
    *outputs,
    reduction=reduction,
    z_loss=options.z_loss,
    return_aux=return_aux,
  )
