"""``linear_log_probs``: per-token log-probabilities and entropies (RL).

The same chunked machinery as ``linear_cross_entropy``
(``_losses.cross_entropy``), asked for per-row outputs: the log-probability of
the label is minus the unsmoothed cross-entropy, and the entropy a fourth
per-row output of the loop orders.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mst_jax._args import inputs as _inputs
from mst_jax._args import options as _options
from mst_jax._gemm import matmul
from mst_jax._losses import cross_entropy as _cross_entropy
from mst_jax._math import ce as ce_math
from mst_jax._sweep import mesh as _mesh

# The loss options that do not apply to log-probabilities.
LOG_PROBS_FIXED = {"reduction": "none", "label_smoothing": 0.0, "z_loss": 0.0}
STATIC_ARGNAMES = (
  *(name for name in _options.OPTION_NAMES if name not in LOG_PROBS_FIXED),
  "weight_layout",
  "return_entropy",
  "mesh",
  "batch_axis",
  "vocab_axis",
)


@_options.public_jit(STATIC_ARGNAMES, per_row_scale=True)
def linear_log_probs(
  hidden: jax.Array,
  weight: jax.Array,
  labels: jax.Array,
  bias: jax.Array | None = None,
  *,
  ignore_index: int = -100,
  where: jax.Array | None = None,
  logit_scale: float | None = None,
  logit_softcap: float | None = None,
  shift: bool = False,
  weight_layout: str = "vd",
  return_entropy: bool = False,
  chunk_size: int | None = None,
  memory_budget: int | None = None,
  vocab_block_size: int | None = None,
  impl: str | None = None,
  accum_dtype: jax.typing.DTypeLike | None = None,
  logits_dtype: jax.typing.DTypeLike | None = None,
  grad_mode: str | None = None,
  mesh: jax.sharding.Mesh | None = None,
  batch_axis: str | None = None,
  vocab_axis: str | None = None,
):
  r"""Per-token log-probabilities of the labels (and entropies), without the logits.

  The RL primitive (PPO / GRPO ratios, KL penalties, entropy bonuses): for
  each token with scores ``s`` (the logits ``hidden @ weight.T + bias``,
  scaled and softcapped as in ``linear_cross_entropy``) and label ``y``::

    log_prob = s[y] - logsumexp(s)            (= log softmax(s)[y])
    entropy  = logsumexp(s) - sum_c softmax(s)_c * s_c

  in row chunks like ``linear_cross_entropy`` (never ``[N, V]``), and
  differentiable with respect to ``hidden``, ``weight`` and ``bias`` for any
  cotangent on either output: by default the forward keeps the logits when
  all rows' fit the memory budget as one group (the backward writes
  ``dlogits`` over them), else the backward recomputes each chunk's.

  Several ids per position (``labels`` of shape ``hidden.shape[:-1] + (K,)``,
  e.g. a teacher's stored top-k, or candidate tokens) give ``[..., K]``
  log-probs, ``log_softmax(s)`` at each id: the logits are formed once per
  chunk whatever K is (they give the log-sum-exp and, read at the ids, the
  ids' scores), gradients flow through all of them, and ``ignore_index``
  entries give 0.0. ``where`` and ``return_entropy`` stay per position;
  ``mesh`` splits the sweep as with one id (arrays typed with Explicit mesh
  axes are not taken yet). K = 1 runs as one label a position.

  Precision: with bfloat16 inputs the logits are bfloat16 by default (as in
  a bfloat16 ``Dense`` head), so a log-prob is off by up to about 1e-2 (a
  PPO / GRPO ratio by up to 1%); ``logits_dtype=jnp.float32`` makes it exact
  to float32 rounding (1e-6) for a few percent more time.

  Args:
    hidden, weight, labels, bias, ignore_index, where, logit_scale,
      logit_softcap, shift, weight_layout: as for ``linear_cross_entropy``;
      ``labels`` may also hold K ids per position (``[..., K]``, see above).
    return_entropy: if True, also return each token's entropy.
    chunk_size, memory_budget, vocab_block_size, impl, accum_dtype,
      logits_dtype, mesh, batch_axis, vocab_axis: the performance options of
      ``linear_cross_entropy``.
    grad_mode: None (keep the logits where they fit, see above) or
      ``"recompute"`` (always recompute them; ``"fused"`` needs a scalar loss
      and raises).

  Returns:
    ``log_probs``, float32 (float64 for float64 inputs) with the shape of
    ``labels``: 0.0 at excluded tokens (and ignored ids), NaN at a valid
    token whose label is outside ``[0, V)``. With ``return_entropy``,
    ``(log_probs, entropy)``, the entropy 0.0 at excluded tokens.

  Raises:
    ValueError, TypeError: as ``linear_cross_entropy`` for bad inputs.
    NotImplementedError: ``grad_mode="fused"``.

  Example:

    >>> import jax, jax.numpy as jnp
    >>> import mst_jax
    >>> k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    >>> hidden = jax.random.normal(k1, (2, 16, 64))
    >>> weight = jax.random.normal(k2, (1000, 64)) * 0.05
    >>> labels = jax.random.randint(k3, (2, 16), 0, 1000)
    >>> log_probs, entropy = mst_jax.linear_log_probs(
    ...     hidden, weight, labels, return_entropy=True)
    >>> log_probs.shape, bool(jnp.all(entropy > 0))
    ((2, 16), True)
  """
  if not isinstance(return_entropy, bool):
    raise TypeError(f"return_entropy must be a bool, got {return_entropy!r}.")
  if grad_mode == "fused":
    raise NotImplementedError(
      "linear_log_probs returns per-token values; grad_mode='fused' needs a"
      " scalar loss. Use grad_mode=None or 'recompute'."
    )
  options, perf = _options.from_arguments({**locals(), **LOG_PROBS_FIXED})
  labels = jnp.asarray(labels)
  one_id = False
  if labels.ndim == jnp.ndim(hidden) and labels.ndim >= 2:  # [..., K] ids
    one_id = labels.shape == (*jnp.shape(hidden)[:-1], 1)
    if not one_id:
      mesh_axes = (mesh, batch_axis, vocab_axis)
      return _at_ids(
        hidden, weight, labels, bias, where, options, perf, weight_layout,
        return_entropy, mesh_axes,
      )  # fmt: skip
    labels = labels[..., 0]  # one id a position: a label
  rows = _inputs.prepare(hidden, weight, labels, bias, where, options, weight_layout)
  layout = _mesh.layout_for(mesh, batch_axis, vocab_axis, weight_layout, rows)
  out = _per_position(rows, options, perf, weight_layout, layout, return_entropy)
  if not one_id:
    return out
  return (out[0][..., None], out[1]) if return_entropy else out[..., None]


def _per_position(rows, options, perf, weight_layout, layout, entropy: bool):
  """``log_probs`` (and, with ``entropy``, the entropy) of the rows' labels,
  in their batch shape."""
  loss, _, _, ent = _cross_entropy.per_row_outputs(
    rows, options, perf, weight_layout, layout, None, entropy=entropy
  )
  log_probs = (0.0 - loss).reshape(rows.batch_shape)  # +0.0 at excluded tokens
  if not entropy:
    return log_probs
  entropy = ent
  return log_probs, entropy.reshape(rows.batch_shape)


def _at_ids(
  hidden, weight, ids, bias, where, options, perf, weight_layout, entropy, mesh_axes
):
  """Log-probs at K ids per position (``ids [..., K]``).

  ``log_softmax(s)[id] = s[id] - lse``: the chunked sweep gives each
  position's lse and entropy and, from the same chunk of logits, the logits
  at its ids (``_sweep.rows.RowInputs.ids``); their cotangents are added to
  that chunk's ``dlogits``. The logits are formed once, whatever K is.
  """
  hidden, weight = jnp.asarray(hidden), jnp.asarray(weight)
  if _inputs.explicit_mesh(hidden, weight, ids, bias) is not None:
    raise NotImplementedError(
      "linear_log_probs at several ids per position (labels [..., K]) does not"
      " take arrays sharded over a mesh with Explicit axes yet; pass mesh= with"
      " batch_axis and vocab_axis and unsharded arrays, or one id per position."
    )
  vocab_size = weight.shape[matmul.vocab_axis(weight_layout)]
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(f"labels must have an integer dtype, got {ids.dtype}.")
  if ids.shape[:-1] != hidden.shape[:-1]:
    raise ValueError(
      f"labels of shape {ids.shape} hold ids per position: their leading shape"
      f" must equal hidden's {hidden.shape[:-1]} (hidden {hidden.shape})."
    )
  ids, valid = _inputs.int32_labels(ids, vocab_size, options.ignore_index)
  if where is not None:
    where = jnp.asarray(where)
    if where.shape != ids.shape[:-1]:
      raise ValueError(
        f"where shape {where.shape} must equal hidden's leading shape"
        f" {ids.shape[:-1]} (one value a position, with ids per position)."
      )
    valid = valid & where[..., None]
  if options.shift:  # position t predicts the ids of position t + 1
    ids, valid = (
      _inputs.shift(ids, vocab_size, axis=-2),
      _inputs.shift(valid, False, axis=-2),
    )
  in_range = (ids >= 0) & (ids < vocab_size)
  usable = valid & in_range
  options = dataclasses.replace(options, shift=False)
  in_vocab = jnp.clip(ids, 0, vocab_size - 1)
  # The sweep's label, an id in the vocabulary, is not ignore_index (but with
  # V = 1), so where= alone picks the positions: those holding an id that is
  # not ignored. Its loss is not used.
  label_id = int(options.ignore_index == 0 and vocab_size > 1)
  label = jnp.full(ids.shape[:-1], label_id, jnp.int32)
  rows = _inputs.prepare(
    hidden, weight, label, bias, jnp.any(valid, -1), options, weight_layout
  )
  rows = rows._replace(ids=in_vocab.reshape(-1, ids.shape[-1]))
  layout = _mesh.layout_for(*mesh_axes, weight_layout, rows)
  _, lse, _, ent, at_ids = _cross_entropy.per_row_outputs(
    rows, options, perf, weight_layout, layout, None, entropy=entropy
  )
  log_probs = ce_math.scores(at_ids, options.ce) - lse[:, None]
  log_probs = log_probs.reshape(ids.shape)
  log_probs = jnp.where(usable, log_probs, 0.0)
  log_probs = jnp.where(valid & ~in_range, jnp.nan, log_probs)
  return log_probs if not entropy else (log_probs, ent.reshape(ids.shape[:-1]))
