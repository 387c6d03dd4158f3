"""``linear_top_k``: each position's k most likely tokens and their
log-probabilities, without the ``[N, V]`` logits.

One pass over row chunks: a chunk's logits, scaled and softcapped as the
losses' scores, give its ``lax.top_k`` and log-sum-exp. Differentiating the
log-probs recomputes them through ``linear_log_probs`` at the ids found.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mst_jax import _plan
from mst_jax._args import inputs as _inputs
from mst_jax._args import options as _options
from mst_jax._gemm import matmul
from mst_jax._losses import log_probs as _log_probs
from mst_jax._math import ce as ce_math

STATIC_ARGNAMES = (
  "k",
  "logit_scale",
  "logit_softcap",
  "weight_layout",
  "chunk_size",
  "memory_budget",
  "logits_dtype",
)

# A chunk's float32 scores and what lax.top_k and the log-sum-exp read beside
# them: this many bytes a logit, besides the logits themselves.
_WORK_BYTES = 8

# Past k = 16 a GPU's lax.top_k sorts whole rows: a top k of each block of
# this many columns, then one of those candidates, is faster there, and
# slower on a CPU (docs/benchmarks.md, "RL heads").
_BLOCK = 512


@_options.public_jit(STATIC_ARGNAMES, per_row_scale=True)
def linear_top_k(
  hidden: jax.Array,
  weight: jax.Array,
  k: int,
  *,
  bias: jax.Array | None = None,
  logit_scale: float | None = None,
  logit_softcap: float | None = None,
  weight_layout: str = "vd",
  chunk_size: int | None = None,
  memory_budget: int | None = None,
  logits_dtype: jax.typing.DTypeLike | None = None,
):
  """Each position's ``k`` largest scores' log-probabilities and ids.

  What an offline distillation pipeline stores from a teacher: with scores
  ``s`` (the logits ``hidden @ weight.T + bias``, scaled and softcapped as in
  ``linear_cross_entropy``), the ids of the ``k`` largest and
  ``log_softmax(s)`` there, largest first (ties: the lower id first), in row
  chunks whose logits fit ``memory_budget`` (never ``[N, V]``).
  Differentiable in ``hidden``, ``weight`` and ``bias`` (the ids are
  constants): the backward recomputes the log-probs at the ids with
  ``linear_log_probs`` (its forward and backward).

  Args:
    hidden: ``[..., D]`` float.
    weight: ``[V, D]`` (``weight_layout="vd"``) or ``[D, V]`` (``"dv"``).
    k: how many ids a position, ``1 <= k <= V``.
    bias, logit_scale, logit_softcap, weight_layout, chunk_size,
      memory_budget, logits_dtype: as for ``linear_cross_entropy``.

  Returns:
    ``(log_probs, ids)``: ``[..., k]`` float32 (float64 for float64 inputs)
    and ``[..., k]`` int32.

  Example:

    >>> import jax, jax.numpy as jnp
    >>> import mst_jax
    >>> k1, k2 = jax.random.split(jax.random.key(0))
    >>> hidden = jax.random.normal(k1, (2, 16, 64))
    >>> weight = jax.random.normal(k2, (1000, 64)) * 0.05
    >>> log_probs, ids = mst_jax.linear_top_k(hidden, weight, 8)
    >>> log_probs.shape, ids.dtype.name
    ((2, 16, 8), 'int32')
  """
  hidden = jnp.asarray(hidden)
  labels = jnp.zeros(hidden.shape[:-1], jnp.int32)  # checks the shapes alone
  options = _options.LossOptions(logit_scale=logit_scale, logit_softcap=logit_softcap)
  rows = _inputs.prepare(hidden, weight, labels, bias, None, options, weight_layout)
  k = _options.check_int("k", k, minimum=1)
  if k > rows.vocab_size:
    raise ValueError(
      f"k must be at most the vocabulary size {rows.vocab_size}, got {k}."
    )
  if chunk_size is not None:
    chunk_size = _options.check_int("chunk_size", chunk_size, minimum=1)
  dtype = _options.resolve_logits_dtype(
    _options.as_dtype("logits_dtype", logits_dtype), rows.hidden.dtype
  )
  head = _Head(
    k,
    weight_layout,
    np.dtype(dtype),
    options.ce,
    _chunk_rows(rows, dtype, chunk_size, memory_budget),
    _plan.matmul_tile(
      jax.default_backend(),
      rows.vocab_size,
      rows.hidden.shape[1],
      memory_budget or _plan.DEFAULT_MEMORY_BUDGET,
    ),
    _blocked(jax.default_backend(), k, rows.vocab_size),
  )
  log_probs, ids = _top_k(head, rows.hidden, rows.weight, rows.bias)
  shape = (*rows.batch_shape, k)
  return log_probs.reshape(shape), ids.reshape(shape)


@dataclasses.dataclass(frozen=True)
class _Head:
  """The static options of one call (hashable: a ``custom_vjp`` argument)."""

  k: int
  weight_layout: str
  logits_dtype: np.dtype
  ce: ce_math.CEOptions
  chunk: int
  tile: int | None
  blocked: bool  # whether _largest takes two stages


def _chunk_rows(rows, logits_dtype, chunk_size, memory_budget) -> int:
  """Rows a chunk: ``chunk_size``, else as many as fit the budget."""
  n_rows = rows.hidden.shape[0]
  if chunk_size is not None:
    return max(1, min(chunk_size, n_rows))
  budget = memory_budget or _plan.DEFAULT_MEMORY_BUDGET
  per_row = rows.vocab_size * (np.dtype(logits_dtype).itemsize + _WORK_BYTES)
  return max(1, min(n_rows, budget // per_row))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _top_k(head: _Head, hidden, weight, bias):
  n_rows, dim = hidden.shape
  size = head.chunk
  blocks = -(-n_rows // size)
  padded = jnp.pad(hidden, ((0, blocks * size - n_rows), (0, 0)))

  def chunk(h):  # [size, D]
    logits = matmul.logits_matmul(
      h, weight, bias, head.weight_layout, head.logits_dtype, tile=head.tile
    )
    scores = ce_math.scores(ce_math.upcast(logits), head.ce)
    values, ids = _largest(scores, head.k, head.blocked)
    lse = jax.nn.logsumexp(scores, axis=-1, keepdims=True)
    return values - lse, ids.astype(jnp.int32)

  if blocks == 1:
    log_probs, ids = chunk(padded)
  else:
    log_probs, ids = lax.map(chunk, padded.reshape(blocks, size, dim))
  log_probs = log_probs.reshape(blocks * size, head.k)[:n_rows]
  return log_probs, ids.reshape(blocks * size, head.k)[:n_rows]


def _blocked(backend: str, k: int, vocab_size: int) -> bool:
  """Whether ``_largest`` takes two stages: on a GPU, 16 < k <= 128, and
  more than one block of columns."""
  return backend == "gpu" and 16 < k <= _BLOCK // 4 and vocab_size > _BLOCK


def _largest(scores, k: int, blocked: bool):
  """``lax.top_k(scores, k)`` of ``[rows, V]`` scores, the same values and
  ids; ``blocked``: the top k of each ``_BLOCK`` columns first.

  Equal scores keep ``lax.top_k``'s order (the lower id first): the
  candidates run in block order, each block's in ``lax.top_k``'s.
  """
  if not blocked:
    return lax.top_k(scores, k)
  rows, width = scores.shape
  blocks = -(-width // _BLOCK)
  padded = jnp.pad(
    scores, ((0, 0), (0, blocks * _BLOCK - width)), constant_values=-jnp.inf
  )
  values, ids = lax.top_k(padded.reshape(rows, blocks, _BLOCK), k)
  ids = ids + _BLOCK * jnp.arange(blocks, dtype=ids.dtype)[:, None]
  values, at = lax.top_k(values.reshape(rows, blocks * k), k)
  return values, jnp.take_along_axis(ids.reshape(rows, blocks * k), at, axis=-1)


def _top_k_fwd(head, hidden, weight, bias):
  log_probs, ids = _top_k(head, hidden, weight, bias)
  return (log_probs, ids), (hidden, weight, bias, ids)


def _top_k_bwd(head, residuals, cotangents):
  hidden, weight, bias, ids = residuals
  g_log_probs, _ = cotangents

  def at_ids(hidden, weight, bias):
    return _log_probs.linear_log_probs(
      hidden,
      weight,
      ids,
      bias,
      logit_scale=head.ce.logit_scale,
      logit_softcap=head.ce.logit_softcap,
      weight_layout=head.weight_layout,
      logits_dtype=head.logits_dtype,
    )

  _, pull = jax.vjp(at_ids, hidden, weight, bias)
  return pull(g_log_probs)


_top_k.defvjp(_top_k_fwd, _top_k_bwd)
