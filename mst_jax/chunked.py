"""The chunked custom-VJP driver: per-row losses without ``[N, V]`` logits.

``row_losses`` walks the rows in chunks of ``rows_per_chunk`` with
``lax.scan``. Each chunk's logits (``[rows_per_chunk, V]``, float32) are formed
by one matmul, reduced by a ``ChunkCE`` backend, and dropped. The forward keeps
only the per-row lse; the backward recomputes each chunk's logits (one matmul,
no second reduction thanks to the saved lse), forms ``dlogits``, writes the
chunk's ``dhidden`` rows and accumulates ``dweight`` / ``dbias``.

Three details carry the design:

* Chunks whose rows are all excluded are skipped with ``lax.cond`` on a
  device-side ``any(valid)``: no host sync, so it works under ``jax.jit``.
* ``N`` need not be a multiple of the chunk: the last chunk is clamped to end
  at row ``N`` (it overlaps the previous one) and rows it does not own are
  excluded and never written. Nothing is padded, so ``hidden`` is never copied.
* ``symbolic_zeros=True`` tells the forward which inputs are differentiated;
  the backward skips the ``dweight`` (or ``dhidden``, ``dbias``) matmul when
  that input is frozen.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from mst_jax import ce_math
from mst_jax.backends import ChunkCE

# lax.dot_general dimension numbers per weight layout.
_LOGITS_DIMS = {  # hidden [C, D] x weight -> [C, V]
  "vd": (((1,), (1,)), ((), ())),
  "dv": (((1,), (0,)), ((), ())),
}
_DHIDDEN_DIMS = {  # dlogits [C, V] x weight -> [C, D]
  "vd": (((1,), (0,)), ((), ())),
  "dv": (((1,), (1,)), ((), ())),
}


@dataclasses.dataclass(frozen=True)
class DriverConfig:
  """Static configuration of ``row_losses``.

  Attributes:
    rows_per_chunk: rows per chunk, ``1 <= rows_per_chunk <= N``.
    weight_layout: ``"vd"`` (weight ``[V, D]``) or ``"dv"`` (``[D, V]``).
    accum_dtype: dtype of the ``dweight`` / ``dbias`` accumulators.
    options: the per-row loss options.
    backend: the per-chunk cross-entropy implementation.
    chunk_callback: if set, ``chunk_callback(pass_name, chunk_index)`` runs on
      the host (``jax.debug.callback``) for every chunk that is computed rather
      than skipped, with ``pass_name`` "forward" or "backward". For tests and
      debugging; it costs a host round trip per chunk.
  """

  rows_per_chunk: int
  weight_layout: str
  accum_dtype: jnp.dtype
  options: ce_math.CEOptions
  backend: ChunkCE
  chunk_callback: Callable[[str, jax.Array], None] | None = None

  def announce(self, pass_name: str, chunk_index: jax.Array) -> None:
    if self.chunk_callback is not None:
      jax.debug.callback(self.chunk_callback, pass_name, chunk_index)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Differentiated:
  """Which inputs the caller differentiates; a static leaf of the residuals."""

  hidden: bool
  weight: bool
  bias: bool


def _logits(hidden, weight, bias, layout):
  acc = jnp.promote_types(hidden.dtype, jnp.float32)
  logits = lax.dot_general(
    hidden, weight, _LOGITS_DIMS[layout], preferred_element_type=acc
  )
  return logits if bias is None else logits + bias.astype(acc)


def _dhidden(dlogits, weight, layout):
  acc = jnp.promote_types(dlogits.dtype, jnp.float32)
  return lax.dot_general(
    dlogits, weight, _DHIDDEN_DIMS[layout], preferred_element_type=acc
  )


def _dweight(dlogits, hidden, layout, accum_dtype):
  contract_rows = (((0,), (0,)), ((), ()))
  if layout == "vd":  # dlogits^T @ hidden -> [V, D]
    return lax.dot_general(
      dlogits, hidden, contract_rows, preferred_element_type=accum_dtype
    )
  # hidden^T @ dlogits -> [D, V]
  return lax.dot_general(
    hidden, dlogits, contract_rows, preferred_element_type=accum_dtype
  )


def _chunk_rows(index, n_rows, rows_per_chunk):
  """First row of chunk ``index`` and which of its rows it owns.

  The last chunk is clamped to end at ``n_rows``; the rows it shares with the
  previous chunk are not its own.
  """
  start = jnp.minimum(index * rows_per_chunk, n_rows - rows_per_chunk)
  owned = start + jnp.arange(rows_per_chunk) >= index * rows_per_chunk
  return start, owned


def _take(x, start, size):
  return lax.dynamic_slice_in_dim(x, start, size, axis=0)


def _put_owned(buffer, rows, start, owned):
  """Writes ``rows`` into ``buffer`` at ``start``, keeping rows not owned."""
  old = _take(buffer, start, rows.shape[0])
  mask = owned.reshape(owned.shape + (1,) * (rows.ndim - 1))
  return lax.dynamic_update_slice_in_dim(buffer, jnp.where(mask, rows, old), start, 0)


def _num_chunks(n_rows, rows_per_chunk):
  return -(-n_rows // rows_per_chunk)


def _forward(config, hidden, weight, bias, labels, valid):
  n_rows = hidden.shape[0]
  chunk = config.rows_per_chunk
  vocab_size = weight.shape[0 if config.weight_layout == "vd" else 1]
  stat_dtype = jnp.promote_types(hidden.dtype, jnp.float32)

  def chunk_outputs(index, h, y, m):
    config.announce("forward", index)
    h = jnp.where(m[:, None], h, jnp.zeros_like(h))  # masked rows never leak
    logits = _logits(h, weight, bias, config.weight_layout)  # [C, V]
    stats = config.backend.forward(logits, y, config.options)
    return ce_math.row_outputs(stats, y, m, config.options, vocab_size)

  def skip(index, h, y, m):
    del index, h, y
    zero = jnp.zeros(m.shape, stat_dtype)
    return zero, zero, jnp.zeros(m.shape, bool)

  def body(carry, index):
    start, owned = _chunk_rows(index, n_rows, chunk)
    h, y = _take(hidden, start, chunk), _take(labels, start, chunk)
    m = _take(valid, start, chunk) & owned
    outs = lax.cond(jnp.any(m), chunk_outputs, skip, index, h, y, m)
    carry = tuple(
      _put_owned(b, o, start, owned) for b, o in zip(carry, outs, strict=True)
    )
    return carry, None

  init = (
    jnp.zeros((n_rows,), stat_dtype),
    jnp.zeros((n_rows,), stat_dtype),
    jnp.zeros((n_rows,), bool),
  )
  (loss, lse, correct), _ = lax.scan(body, init, jnp.arange(_num_chunks(n_rows, chunk)))
  return loss, lse, correct


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def row_losses(config, hidden, weight, bias, labels, valid):
  """Per-row loss, lse and argmax-correctness, chunk by chunk.

  Args:
    config: a ``DriverConfig``.
    hidden: ``[N, D]`` float.
    weight: ``[V, D]`` or ``[D, V]`` (``config.weight_layout``), hidden's dtype.
    bias: ``[V]`` float or None.
    labels: int32 ``[N]``.
    valid: bool ``[N]``; False rows give 0 loss, 0 lse and zero gradients.

  Returns:
    ``(loss, lse, correct)``: ``[N]`` float32 (float64 for float64 inputs),
    ``[N]`` float32 and ``[N]`` bool. ``loss`` and ``lse`` are differentiable.
  """
  return _forward(config, hidden, weight, bias, labels, valid)


def _row_losses_fwd(config, hidden, weight, bias, labels, valid):
  differentiated = _Differentiated(
    hidden=hidden.perturbed,
    weight=weight.perturbed,
    bias=bias is not None and bias.perturbed,  # None has no leaves to wrap
  )
  hidden, weight = hidden.value, weight.value
  bias = None if bias is None else bias.value
  labels, valid = labels.value, valid.value
  loss, lse, correct = _forward(config, hidden, weight, bias, labels, valid)
  residuals = (hidden, weight, bias, labels, valid, lse, differentiated)
  return (loss, lse, correct), residuals


def _instantiate(cotangent, like):
  if isinstance(cotangent, jax.custom_derivatives.SymbolicZero):
    return jnp.zeros_like(like)
  return cotangent


def _row_losses_bwd(config, residuals, cotangents):
  hidden, weight, bias, labels, valid, lse, differentiated = residuals
  g_loss = _instantiate(cotangents[0], lse)
  g_lse = _instantiate(cotangents[1], lse)
  n_rows = hidden.shape[0]
  chunk = config.rows_per_chunk
  layout = config.weight_layout
  vocab_size = weight.shape[0 if layout == "vd" else 1]

  @jax.checkpoint  # grad-of-grad recomputes the chunk instead of saving logits
  def chunk_update(carry, index, start, owned, m):
    config.announce("backward", index)
    dhidden, dweight, dbias = carry
    h = jnp.where(m[:, None], _take(hidden, start, chunk), 0)
    y = _take(labels, start, chunk)
    rows = ce_math.backward_rows(
      _take(g_loss, start, chunk),
      _take(g_lse, start, chunk),
      _take(lse, start, chunk),
      y,
      m,
      config.options,
      vocab_size,
    )
    logits = _logits(h, weight, bias, layout)  # recomputed, [C, V]
    dlogits = config.backend.backward(logits, y, rows, config.options, hidden.dtype)
    if dhidden is not None:
      dh = _dhidden(dlogits, weight, layout).astype(hidden.dtype)
      dhidden = _put_owned(dhidden, dh, start, owned)
    if dweight is not None:
      dweight = dweight + _dweight(dlogits, h, layout, config.accum_dtype)
    if dbias is not None:
      dbias = dbias + jnp.sum(dlogits, axis=0, dtype=config.accum_dtype)
    return dhidden, dweight, dbias

  def body(carry, index):
    start, owned = _chunk_rows(index, n_rows, chunk)
    m = _take(valid, start, chunk) & owned
    carry = lax.cond(
      jnp.any(m),
      chunk_update,
      lambda carry, *_: carry,
      carry,
      index,
      start,
      owned,
      m,
    )
    return carry, None

  init = (
    jnp.zeros_like(hidden) if differentiated.hidden else None,
    jnp.zeros(weight.shape, config.accum_dtype) if differentiated.weight else None,
    jnp.zeros(bias.shape, config.accum_dtype) if differentiated.bias else None,
  )
  (dhidden, dweight, dbias), _ = lax.scan(
    body, init, jnp.arange(_num_chunks(n_rows, chunk))
  )
  if dweight is not None:
    dweight = dweight.astype(weight.dtype)
  if dbias is not None:
    dbias = dbias.astype(bias.dtype)
  return dhidden, dweight, dbias, None, None


row_losses.defvjp(_row_losses_fwd, _row_losses_bwd, symbolic_zeros=True)
