"""The chunked custom-VJP driver: the loss without ``[N, V]`` logits.

Rows are walked in chunks of ``rows_per_chunk`` with ``lax.scan``. Each
chunk's logits (``[rows_per_chunk, V]``, in ``logits_dtype``: float32, or
bfloat16 for bfloat16 inputs by default) are formed by one matmul, handed to a
``ChunkCE`` backend (which computes in float32), and dropped. Two custom VJPs share that
sweep:

* ``row_losses`` (the Mini-Sequence Transformer design): the forward keeps
  only the per-row lse; the backward recomputes each chunk's logits (one
  matmul, no second reduction thanks to the saved lse), forms ``dlogits``,
  writes the chunk's ``dhidden`` rows and accumulates ``dweight`` / ``dbias``.
  8 N·D·V FLOPs; per-row outputs, so every reduction works.
* ``reduced_loss`` (gradient in the forward): for a scalar loss the cotangent
  of each row is known up to one scalar factor, so the forward forms
  ``dlogits`` in the same sweep as the loss (one fused kernel), and the
  chunk's ``dhidden`` and ``dweight`` contribution with it; the backward only
  scales them. 6 N·D·V FLOPs, like full-logits autodiff.

Details they share:

* Compaction: valid rows are stably moved to the front (a device-side
  ``argsort``, no host sync), so every chunk past the number of valid rows is
  entirely excluded; such chunks are skipped with ``lax.cond`` on a device-side
  ``any(valid)``. Scattered masks then save as much as prefix masks.
* ``N`` need not be a multiple of the chunk: the last chunk is clamped to end
  at row ``N`` (it overlaps the previous one) and rows it does not own are
  excluded and never written. Nothing is padded.
* ``symbolic_zeros=True`` tells the forward which inputs are differentiated;
  the ``dweight`` (or ``dhidden``, ``dbias``) matmul of a frozen input is not
  in the program at all.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from mst_jax import ce_math
from mst_jax.backends import ChunkCE
from mst_jax.config import dlogits_in_place

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
  """Static configuration of the chunked sweeps.

  Attributes:
    rows_per_chunk: rows whose logits exist at once (outside whole groups),
      ``1 <= rows_per_chunk <= rows_per_group``.
    rows_per_group: rows whose ``dhidden`` and ``dweight`` matmuls run at once
      when all of them count (``config.plan_chunks``), ``<= N``.
    weight_layout: ``"vd"`` (weight ``[V, D]``) or ``"dv"`` (``[D, V]``).
    accum_dtype: dtype of the ``dweight`` / ``dbias`` accumulators; None
      accumulates ``dweight`` in the weight's dtype, in place in the output
      (one rounding per group), and ``dbias`` in at least float32.
    options: the per-row loss options.
    backend: the per-chunk cross-entropy implementation.
    compact: move valid rows to the front before chunking.
    vocab_total: the whole vocabulary when ``weight`` holds one shard of it
      (vocab-parallel); default: the weight's.
    vocab_block: if set, the low-memory loop order (``mst_jax.vocab_blocked``):
      each row chunk walks the vocabulary in blocks of this many columns.
    logits_dtype: dtype the logits matmul writes; None: at least float32.
      In the compute dtype (bfloat16), a chunk's ``dlogits`` overwrite its
      logits in place and the logits traffic halves.
    chunk_callback: if set, ``chunk_callback(pass_name, first_row)`` runs on
      the host (``jax.debug.callback``) for every block of rows whose logits
      are formed (a chunk, or a whole group when all its rows count) rather
      than skipped, with ``pass_name`` "forward", "backward" or "fused" and
      the block's first row (in compacted order). For tests and debugging; it
      costs a host round trip per block.
  """

  rows_per_chunk: int
  rows_per_group: int
  weight_layout: str
  accum_dtype: jnp.dtype | None
  options: ce_math.CEOptions
  backend: ChunkCE
  compact: bool = True
  chunk_callback: Callable[[str, jax.Array], None] | None = None
  vocab_total: int | None = None
  vocab_block: int | None = None
  logits_dtype: jnp.dtype | None = None

  def announce(self, pass_name: str, first_row: jax.Array) -> None:
    if self.chunk_callback is not None:
      jax.debug.callback(self.chunk_callback, pass_name, first_row)

  def vocab_size(self, weight: jax.Array) -> int:
    if self.vocab_total is not None:
      return self.vocab_total
    return weight.shape[0 if self.weight_layout == "vd" else 1]


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Differentiated:
  """Which inputs the caller differentiates; a static leaf of the residuals."""

  hidden: bool
  weight: bool
  bias: bool

  @classmethod
  def of(cls, hidden, weight, bias):
    """From the ``CustomVJPPrimal`` inputs of a ``symbolic_zeros`` forward."""
    return cls(
      hidden=hidden.perturbed,
      weight=weight.perturbed,
      bias=bias is not None and bias.perturbed,  # None has no leaves to wrap
    )


def _unwrap(*primals):
  return tuple(None if p is None else p.value for p in primals)


# ---- Matmuls, per weight layout. ----


def logits_matmul(hidden, weight, bias, layout, dtype=None):
  """``hidden @ weight (+ bias)`` in ``dtype`` (default: at least float32).

  ``dtype`` is what the matmul writes (with a bias, after adding it in float32:
  one rounding). For a narrower ``dtype`` the accumulation precision is the
  backend's: cuBLAS and XLA:CPU accumulate bfloat16 products in float32.
  """
  acc = jnp.promote_types(hidden.dtype, jnp.float32)
  dtype = dtype or acc
  if bias is None:
    return lax.dot_general(
      hidden, weight, _LOGITS_DIMS[layout], preferred_element_type=dtype
    )
  logits = lax.dot_general(
    hidden, weight, _LOGITS_DIMS[layout], preferred_element_type=acc
  )
  return (logits + bias.astype(acc)).astype(dtype)


def dhidden_matmul(dlogits, weight, layout, dtype):
  """``dlogits @ weight`` written in ``dtype``.

  The matmul accumulates in float32 and rounds once to ``dtype``, as the naive
  head's backward pass does; asking for a float32 result and converting would
  hold a float32 ``[rows, D]`` temporary (and, where XLA splits the long
  vocabulary contraction, several).
  """
  return lax.dot_general(
    dlogits, weight, _DHIDDEN_DIMS[layout], preferred_element_type=dtype
  )


def dweight_matmul(dlogits, hidden, layout, accum_dtype):
  contract_rows = (((0,), (0,)), ((), ()))
  # "vd": dlogits^T @ hidden -> [V, D]; "dv": hidden^T @ dlogits -> [D, V].
  operands = (dlogits, hidden) if layout == "vd" else (hidden, dlogits)
  return lax.dot_general(*operands, contract_rows, preferred_element_type=accum_dtype)


# ---- Chunks and groups. ----


class _Chunk(NamedTuple):
  """A run of consecutive rows: a chunk, or a group of chunks.

  Attributes:
    start: its first row (global).
    offset: its first row within its group (its start, for a group).
    owned: bool ``[size]``: rows no earlier sibling or enclosing group covered.
    local_owned: bool ``[size]``: rows no earlier sibling in the group covered.
    valid: bool ``[size]``: owned rows that count.
  """

  start: jax.Array
  offset: jax.Array
  owned: jax.Array
  local_owned: jax.Array
  valid: jax.Array

  @property
  def size(self) -> int:
    return self.owned.shape[0]

  def take(self, x):
    if isinstance(x, Permuted):
      return jnp.take(x.array, self.take(x.order), axis=0)
    return lax.dynamic_slice_in_dim(x, self.start, self.size, axis=0)

  def put(self, buffer, rows, *, local=False):
    """Writes ``rows`` into a global (or, ``local``, a group's) buffer.

    Rows the chunk does not own keep the buffer's value.
    """
    owned, start = (
      (self.local_owned, self.offset) if local else (self.owned, self.start)
    )
    mask = owned.reshape(owned.shape + (1,) * (rows.ndim - 1))
    if isinstance(buffer, Permuted):  # the chunk's rows are distinct: in place
      if local:
        raise ValueError("a Permuted buffer holds all rows, not a group's")
      index = self.take(buffer.order)
      new = jnp.where(mask, rows, jnp.take(buffer.array, index, axis=0))
      return buffer._replace(array=buffer.array.at[index].set(new, unique_indices=True))
    old = lax.dynamic_slice_in_dim(buffer, start, self.size, axis=0)
    return lax.dynamic_update_slice_in_dim(buffer, jnp.where(mask, rows, old), start, 0)

  def hidden(self, hidden):
    """The chunk's hidden rows, excluded rows zeroed: they never leak."""
    h = self.take(hidden)
    return jnp.where(self.valid[:, None], h, jnp.zeros_like(h))


def chunk_of(size, valid, index, group=None) -> _Chunk:
  """Chunk ``index`` of ``size`` rows of ``valid`` (all rows, or ``group``'s).

  The last chunk is clamped to end at the last row and owns only the rows the
  previous chunk did not cover.
  """
  n_rows = valid.shape[0]
  offset = jnp.minimum(index * size, n_rows - size)
  local_owned = offset + jnp.arange(size) >= index * size
  owned, start = local_owned, offset
  if group is not None:
    owned = local_owned & lax.dynamic_slice_in_dim(group.owned, offset, size)
    start = group.start + offset
  chunk_valid = lax.dynamic_slice_in_dim(valid, offset, size) & local_owned
  return _Chunk(start, offset, owned, local_owned, chunk_valid)


def sweep_chunks(size, valid, update, carry, *, group=None, first=None, visit=None):
  """``carry = update(carry, chunk)`` for every chunk of ``size`` rows to visit.

  Walks the rows of ``valid`` (all rows, or those of ``group``) in chunks
  (``chunk_of``). A chunk without a valid row (or, with ``visit``, one where
  ``visit(chunk)`` is false) is skipped by ``lax.cond`` on a device-side
  predicate (the carry passes through). With ``first``, chunk 0 runs
  ``first(carry, chunk)`` instead, always (it may start accumulators rather
  than add to zeros).
  """
  visit = visit or (lambda chunk: jnp.any(chunk.valid))
  chunk_at = lambda index: chunk_of(size, valid, index, group)
  skipped = lambda carry, chunk: carry

  def body(carry, index):
    chunk = chunk_at(index)
    return lax.cond(visit(chunk), update, skipped, carry, chunk), None

  indices = jnp.arange(-(-valid.shape[0] // size))
  if first is not None:
    carry = first(carry, chunk_at(0))
    indices = indices[1:]
  carry, _ = lax.scan(body, carry, indices)
  return carry


def _zeros_if(flag, shape, dtype):
  return jnp.zeros(shape, dtype) if flag else None


# ---- Compaction: valid rows first. ----


class Permuted(NamedTuple):
  """``array`` seen in the row order ``order`` (``view[i] = array[order[i]]``).

  Chunks gather their rows from it and scatter theirs into it, so the
  ``[N, D]`` hidden states and their gradient are never copied whole into
  compacted order and back.
  """

  array: jax.Array
  order: jax.Array  # int32 [N], a permutation

  @property
  def shape(self):
    return self.array.shape

  @property
  def dtype(self):
    return self.array.dtype


def _compaction(config, valid):
  """``(gather, scatter, view)``: into compacted row order and back.

  ``gather`` and ``scatter`` copy (for per-row ``[N]`` arrays); ``view`` wraps
  an ``[N, D]`` array as ``Permuted`` without copying it.
  """
  if not config.compact:
    identity = lambda x: x
    return identity, identity, identity
  order = jnp.argsort(jnp.logical_not(valid), stable=True).astype(jnp.int32)
  gather = lambda x: jnp.take(x, order, axis=0)
  scatter = lambda x: jnp.zeros_like(x).at[order].set(x, unique_indices=True)
  return gather, scatter, lambda x: Permuted(x, order)


def _array(x):
  """The array of a (possibly ``Permuted``) buffer, in the original row order."""
  return x.array if isinstance(x, Permuted) else x


# ---- The sweeps. ----


def output_init(n_rows, dtype):
  """Per-row ``(loss, lse, correct)`` buffers; excluded rows stay zero."""
  return (
    jnp.zeros((n_rows,), dtype),
    jnp.zeros((n_rows,), dtype),
    jnp.zeros((n_rows,), bool),
  )


def full_row_stats(config, h, weight, bias, labels) -> ce_math.RowStats:
  """A chunk's row statistics from its whole ``[rows, V]`` float32 logits."""
  logits = logits_matmul(h, weight, bias, config.weight_layout, config.logits_dtype)
  return config.backend.forward(logits, labels, config.options)


def forward_rows(config, hidden, weight, bias, labels, valid, row_stats=full_row_stats):
  """Per-row ``(loss, lse, correct)``, in the given row order.

  ``row_stats(config, h, weight, bias, labels)`` reduces one chunk's rows.
  """
  vocab_size = config.vocab_size(weight)

  def update(outputs, chunk):
    config.announce("forward", chunk.start)
    y = chunk.take(labels)
    stats = row_stats(config, chunk.hidden(hidden), weight, bias, y)
    rows = ce_math.row_outputs(stats, y, chunk.valid, config.options, vocab_size)
    return tuple(map(chunk.put, outputs, rows))

  stat_dtype = jnp.promote_types(hidden.dtype, jnp.float32)
  init = output_init(hidden.shape[0], stat_dtype)
  return sweep_chunks(config.rows_per_chunk, valid, update, init)


def _accumulate(config, grads, group, h, dlogits, weight, *, first=False, local=False):
  """Adds one group's ``dlogits`` to ``(dhidden, dweight, dbias)``.

  ``first``: the first group's contributions replace the (zero) ``dweight``
  and ``dbias`` instead of being added to them, which spares a pass of
  zero-filling and re-reading ``dweight``. ``local``: ``dhidden`` is the
  enclosing group's rows, not all rows.
  """
  dhidden, dweight, dbias = grads
  layout = config.weight_layout
  add = (lambda old, new: new) if first else jnp.add
  if dhidden is not None:
    dh = dhidden_matmul(dlogits, weight, layout, dhidden.dtype)
    dhidden = group.put(dhidden, dh, local=local)
  if dweight is not None:
    dweight = add(dweight, dweight_matmul(dlogits, h, layout, dweight.dtype))
  if dbias is not None:
    dbias = add(dbias, jnp.sum(dlogits, axis=0, dtype=dbias.dtype))
  return dhidden, dweight, dbias


def gradient_init(config, hidden, weight, bias, diff):
  """Zero ``(dhidden, dweight, dbias)`` accumulators (None: not differentiated).

  ``dhidden`` is ``Permuted`` like ``hidden``.
  """
  dbias = None
  if diff.bias:  # [V] only: always accumulated in at least float32
    accum = config.accum_dtype or jnp.promote_types(bias.dtype, jnp.float32)
    dbias = jnp.zeros(bias.shape, accum)
  dhidden = _zeros_if(diff.hidden, hidden.shape, hidden.dtype)
  if dhidden is not None and isinstance(hidden, Permuted):
    dhidden = hidden._replace(array=dhidden)
  return (
    dhidden,
    _zeros_if(diff.weight, weight.shape, config.accum_dtype or weight.dtype),
    dbias,
  )


def gradient_finish(grads, weight, bias):
  """The accumulators in their inputs' dtypes (and ``dhidden`` in row order)."""
  dhidden, dweight, dbias = grads
  if dhidden is not None:
    dhidden = _array(dhidden)
  if dweight is not None:
    dweight = dweight.astype(weight.dtype)
  if dbias is not None:
    dbias = dbias.astype(bias.dtype)
  return dhidden, dweight, dbias


def _gradient_sweep(config, hidden, weight, bias, valid, diff, chunk_dlogits, outputs):
  """Gradients from ``chunk_dlogits``, group by group.

  ``chunk_dlogits(outputs, chunk, into) -> (outputs, dlogits)`` gives each
  chunk's (or group's) dlogits (with ``into=(buffer, row)``, written into
  ``buffer`` from ``row`` on, and the buffer returned). A group whose rows all
  count does the ``dhidden`` and ``dweight`` matmuls over the whole group, so
  ``dweight`` is read and written once per group rather than once per chunk:
  with logits in the compute dtype, the group's logits come from one matmul
  and its dlogits overwrite them; with float32 logits, its chunks' dlogits are
  gathered into one ``[group, V]`` buffer. A group with excluded rows (the one
  where compacted valid rows end, or the clamped last group) goes chunk by
  chunk instead, skipping empty chunks, so excluded rows cost no matmul. The
  two kinds of group are walked in two loops: a ``lax.cond`` between them
  inside one loop made XLA copy the carried ``dweight`` (1 GiB at the Llama-3
  head).

  Compacted, the first group starts the ``dweight`` / ``dbias`` accumulators
  with its contribution (no zero-filled ``[V, D]`` to add to); it chooses
  between whole and chunked in the one ``lax.cond`` outside the loops.

  Returns:
    ``(outputs, (dhidden, dweight, dbias))``; a gradient is None where ``diff``
    says its input is not differentiated.
  """
  group_size, chunk_size = config.rows_per_group, config.rows_per_chunk
  logits_dtype = config.logits_dtype or jnp.promote_types(hidden.dtype, jnp.float32)
  logits_in_place = dlogits_in_place(logits_dtype, hidden.dtype)

  def chunk_update(carry, chunk, first=False, local=False):
    outputs, grads = carry
    outputs, dlogits = chunk_dlogits(outputs, chunk, None)
    h = chunk.hidden(hidden)
    grads = _accumulate(
      config, grads, chunk, h, dlogits, weight, first=first, local=local
    )
    return outputs, grads

  def chunk_by_chunk(carry, group):
    return sweep_chunks(chunk_size, group.valid, chunk_update, carry, group=group)

  grads = gradient_init(config, hidden, weight, bias, diff)
  specs = [None if g is None else (g.shape, g.dtype) for g in grads[1:]]
  whole_rows = lambda group: jnp.all(group.valid)
  partial_rows = lambda group: jnp.any(group.valid) & ~whole_rows(group)

  # Compacted, the first chunk (or group) holds a valid row unless none does;
  # it starts dweight / dbias, so their zeros are never read.
  starts = config.compact
  if chunk_size == group_size:
    first = functools.partial(chunk_update, first=True) if starts else None
    outputs, grads = sweep_chunks(
      chunk_size, valid, chunk_update, (outputs, grads), first=first
    )
  elif logits_in_place:
    # Groups whose rows all count run whole; the others (with compaction,
    # the one where the valid rows end) chunk by chunk: two loops, no lax.cond
    # between the two ways inside a loop (XLA copied dweight around it). Each
    # group's dhidden rows come back as [group, D] and are written outside.
    layout, dh_dtype = config.weight_layout, hidden.dtype
    want_rows = grads[0] is not None

    def whole(outputs, dweight, dbias, group, first):
      outputs, dlogits = chunk_dlogits(outputs, group, None)
      h = group.hidden(hidden)
      _, dweight, dbias = _accumulate(
        config, (None, dweight, dbias), group, h, dlogits, weight, first=first
      )
      rows = dhidden_matmul(dlogits, weight, layout, dh_dtype) if want_rows else None
      return outputs, rows, dweight, dbias

    def by_chunk(outputs, dweight, dbias, group, first):
      update = functools.partial(chunk_update, local=True)
      rows = jnp.zeros((group.size, hidden.shape[1]), dh_dtype) if want_rows else None
      outputs, (rows, dweight, dbias) = sweep_chunks(
        chunk_size,
        group.valid,
        update,
        (outputs, (rows, dweight, dbias)),
        group=group,
        first=functools.partial(update, first=True) if first else None,
      )
      return outputs, rows, dweight, dbias

    def group_update(part):
      def run(carry, group):
        outputs, (dhidden, dweight, dbias) = carry
        outputs, rows, dweight, dbias = part(outputs, dweight, dbias, group, False)
        if want_rows:
          dhidden = group.put(dhidden, rows)
        return outputs, (dhidden, dweight, dbias)

      return run

    def started(part):  # the zeros made here are never read
      def run(outputs, group):
        zeros = (None if s is None else jnp.zeros(*s) for s in specs)
        return part(outputs, *zeros, group, True)

      return run

    dhidden, dweight, dbias = grads
    later = lambda group: True
    if starts:
      # Group 0 holds the first valid rows (if any): it starts dweight and
      # dbias, whole or chunk by chunk; neither branch takes them (or dhidden)
      # as operands.
      group = chunk_of(group_size, valid, 0)
      outputs, rows, dweight, dbias = lax.cond(
        whole_rows(group), started(whole), started(by_chunk), outputs, group
      )
      if want_rows:
        dhidden = group.put(dhidden, rows)
      later = lambda group: group.offset > 0
    carry = sweep_chunks(
      group_size,
      valid,
      group_update(whole),
      (outputs, (dhidden, dweight, dbias)),
      visit=lambda g: whole_rows(g) & later(g),
    )
    outputs, grads = sweep_chunks(
      group_size,
      valid,
      group_update(by_chunk),
      carry,
      visit=lambda g: partial_rows(g) & later(g),
    )
  else:
    # float32 logits chunk by chunk into a group buffer; chunks that tile the
    # group exactly let the backend write into it in place. Whole groups and
    # the others in two loops, as above.
    into_buffer = group_size % chunk_size == 0

    def whole_group(carry, group):
      outputs, grads, buffer = carry

      def fill(carry, chunk):
        outputs, buffer = carry
        if into_buffer:
          return chunk_dlogits(outputs, chunk, (buffer, chunk.offset))
        outputs, dlogits = chunk_dlogits(outputs, chunk, None)
        return outputs, chunk.put(buffer, dlogits, local=True)

      outputs, buffer = sweep_chunks(
        chunk_size, group.valid, fill, (outputs, buffer), group=group
      )
      h = group.hidden(hidden)
      grads = _accumulate(config, grads, group, h, buffer, weight)
      return outputs, grads, buffer

    width = weight.shape[0 if config.weight_layout == "vd" else 1]  # this shard's
    buffer = jnp.zeros((group_size, width), hidden.dtype)
    outputs, grads, _ = sweep_chunks(
      group_size, valid, whole_group, (outputs, grads, buffer), visit=whole_rows
    )
    outputs, grads = sweep_chunks(
      group_size, valid, chunk_by_chunk, (outputs, grads), visit=partial_rows
    )
  return outputs, gradient_finish(grads, weight, bias)


def _backward(config, hidden, weight, bias, labels, valid, lse, g_loss, g_lse, diff):
  """``(dhidden, dweight, dbias)`` by recomputing each chunk's logits."""
  vocab_size = config.vocab_size(weight)

  def chunk_dlogits(outputs, chunk, into):
    config.announce("backward", chunk.start)
    y = chunk.take(labels)
    rows = ce_math.backward_rows(
      chunk.take(g_loss),
      chunk.take(g_lse),
      chunk.take(lse),
      y,
      chunk.valid,
      config.options,
      vocab_size,
    )
    logits = logits_matmul(
      chunk.hidden(hidden), weight, bias, config.weight_layout, config.logits_dtype
    )
    dlogits = config.backend.backward(logits, y, rows, config.options, hidden.dtype)
    if into is not None:
      buffer, row = into
      dlogits = lax.dynamic_update_slice_in_dim(buffer, dlogits, row, 0)
    return outputs, dlogits

  # grad-of-grad recomputes the chunk instead of saving its logits.
  chunk_dlogits = jax.checkpoint(chunk_dlogits)
  _, grads = _gradient_sweep(
    config, hidden, weight, bias, valid, diff, chunk_dlogits, ()
  )
  return grads


def _fused(config, hidden, weight, bias, labels, valid, row_scale, diff):
  """Per-row outputs and the gradients of ``sum(loss * row_scale)``, one sweep."""
  vocab_size = config.vocab_size(weight)

  def chunk_dlogits(outputs, chunk, into):
    config.announce("fused", chunk.start)
    y = chunk.take(labels)
    g_loss = jnp.where(chunk.valid, chunk.take(row_scale), 0.0)
    logits = logits_matmul(
      chunk.hidden(hidden), weight, bias, config.weight_layout, config.logits_dtype
    )
    stats, dlogits = config.backend.forward_backward(
      logits, y, chunk.valid, g_loss, config.options, hidden.dtype, into=into
    )
    rows = ce_math.row_outputs(stats, y, chunk.valid, config.options, vocab_size)
    return tuple(map(chunk.put, outputs, rows)), dlogits

  stat_dtype = jnp.promote_types(hidden.dtype, jnp.float32)
  init = output_init(hidden.shape[0], stat_dtype)
  return _gradient_sweep(config, hidden, weight, bias, valid, diff, chunk_dlogits, init)


def compacted_forward(config, hidden, weight, bias, labels, valid):
  """Per-row ``(loss, lse, correct)``, valid rows compacted to the front."""
  gather, scatter, view = _compaction(config, valid)
  outputs = forward_rows(
    config, view(hidden), weight, bias, gather(labels), gather(valid)
  )
  return tuple(map(scatter, outputs))


def compacted_backward(
  config, hidden, weight, bias, labels, valid, lse, g_loss, g_lse, diff
):
  """``(dhidden, dweight, dbias)`` of the recompute path, rows compacted."""
  gather, _, view = _compaction(config, valid)  # recomputed: cheaper than saved
  return _backward(
    config,
    view(hidden),
    weight,
    bias,
    *map(gather, (labels, valid, lse, g_loss, g_lse)),
    diff,
  )


def compacted_fused(config, hidden, weight, bias, labels, valid, row_scale, diff):
  """``((sum(loss * row_scale), lse, correct), grads)`` in one sweep, compacted."""
  gather, scatter, view = _compaction(config, valid)
  (loss, lse, correct), grads = _fused(
    config,
    view(hidden),
    weight,
    bias,
    *map(gather, (labels, valid, row_scale)),
    diff,
  )
  outputs = (jnp.sum(loss * gather(row_scale)), scatter(lse), scatter(correct))
  return outputs, grads


class Plan(NamedTuple):
  """How the custom VJPs run their three computations (a static, hashable value).

  ``plan_for(config)`` runs them on the arrays as given;
  ``mst_jax.sharded`` runs them per device inside ``shard_map``.
  """

  config: DriverConfig
  forward: Callable
  backward: Callable
  fused: Callable


def plan_for(config: DriverConfig) -> Plan:
  """The single-device plan: row chunks, or vocabulary blocks within them."""
  if config.vocab_block is not None:
    from mst_jax import vocab_blocked  # it builds on this module

    return Plan(
      config, vocab_blocked.forward, vocab_blocked.backward, vocab_blocked.fused
    )
  return Plan(config, compacted_forward, compacted_backward, compacted_fused)


def _instantiate(cotangent, like):
  if isinstance(cotangent, jax.custom_derivatives.SymbolicZero):
    return jnp.zeros_like(like)
  return cotangent


# ---- The recompute custom VJP: per-row outputs. ----


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def row_losses(plan, hidden, weight, bias, labels, valid):
  """Per-row loss, lse and argmax-correctness; the backward recomputes logits.

  Args:
    plan: a ``Plan`` (``plan_for(config)`` with a ``DriverConfig``).
    hidden: ``[N, D]`` float.
    weight: ``[V, D]`` or ``[D, V]`` (``config.weight_layout``), hidden's dtype.
    bias: ``[V]`` float or None.
    labels: int32 ``[N]``.
    valid: bool ``[N]``; False rows give 0 loss, 0 lse and zero gradients.

  Returns:
    ``(loss, lse, correct)``: ``[N]`` float32 (float64 for float64 inputs),
    ``[N]`` float32 and ``[N]`` bool. ``loss`` and ``lse`` are differentiable.
  """
  return plan.forward(plan.config, hidden, weight, bias, labels, valid)


def _row_losses_fwd(plan, hidden, weight, bias, labels, valid):
  differentiated = _Differentiated.of(hidden, weight, bias)
  hidden, weight, bias, labels, valid = _unwrap(hidden, weight, bias, labels, valid)
  outputs = plan.forward(plan.config, hidden, weight, bias, labels, valid)
  residuals = (hidden, weight, bias, labels, valid, outputs[1], differentiated)
  return outputs, residuals


def _row_losses_bwd(plan, residuals, cotangents):
  hidden, weight, bias, labels, valid, lse, differentiated = residuals
  g_loss = _instantiate(cotangents[0], lse)
  g_lse = _instantiate(cotangents[1], lse)
  grads = plan.backward(
    plan.config, hidden, weight, bias, labels, valid, lse, g_loss, g_lse, differentiated
  )
  return (*grads, None, None)


row_losses.defvjp(_row_losses_fwd, _row_losses_bwd, symbolic_zeros=True)


# ---- The gradient-in-forward custom VJP: a scalar loss. ----


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def reduced_loss(plan, hidden, weight, bias, labels, valid, row_scale):
  """``sum(loss * row_scale)``, per-row lse and correctness; grads in the forward.

  Args:
    plan, hidden, weight, bias, labels, valid: as for ``row_losses``.
    row_scale: float32 ``[N]``, each row's weight in the scalar loss (for a
      mean, ``valid / n_valid``); not differentiated.

  Returns:
    ``(loss, lse, correct)``: the scalar loss, ``[N]`` lse and ``[N]`` bool.
    Only ``loss`` is differentiable: differentiating through ``lse`` raises
    (use ``row_losses``).
  """
  loss, lse, correct = plan.forward(plan.config, hidden, weight, bias, labels, valid)
  return jnp.sum(loss * row_scale), lse, correct


def _reduced_loss_fwd(plan, hidden, weight, bias, labels, valid, row_scale):
  differentiated = _Differentiated.of(hidden, weight, bias)
  args = _unwrap(hidden, weight, bias, labels, valid, row_scale)
  return plan.fused(plan.config, *args, differentiated)


def _reduced_loss_bwd(plan, residuals, cotangents):
  del plan
  g_loss, g_lse, _ = cotangents
  if not isinstance(g_lse, jax.custom_derivatives.SymbolicZero):
    raise NotImplementedError(
      "The per-token lse (aux.lse, aux.z_loss) is not differentiable with"
      " grad_mode='fused', which forms the gradient during the forward pass;"
      " use grad_mode='recompute' to differentiate through it."
    )
  if isinstance(g_loss, jax.custom_derivatives.SymbolicZero):
    return None, None, None, None, None, None
  scale = lambda grad: None if grad is None else (grad * g_loss).astype(grad.dtype)
  dhidden, dweight, dbias = map(scale, residuals)
  return dhidden, dweight, dbias, None, None, None


reduced_loss.defvjp(_reduced_loss_fwd, _reduced_loss_bwd, symbolic_zeros=True)
