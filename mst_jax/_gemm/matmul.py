"""The LM head's three matmuls, for either weight layout.

The weight is ``[V, D]`` (``"vd"``: an embedding table, a torch
``lm_head.weight``) or ``[D, V]`` (``"dv"``: a Flax Dense kernel). Everything
that depends on the layout is here, so the loop orders never transpose (or
copy) the weight. (One caller does: a ``[D, V]`` weight whose rows TMA cannot
copy is transposed once per step for the Mosaic kernels, by
``_losses.cross_entropy``, where ``transposes_weight`` of the backend asks for
it.)

``gemm`` says what runs a product: ``"xla"`` (``lax.dot_general``) or
``"mosaic"``: the Mosaic GPU kernel (``_gemm.mosaic.gemm``, Hopper), for the
products whose shapes it takes, ``lax.dot_general`` for the others. XLA
autotunes each GEMM it compiles on fresh buffers of its operands' and
output's sizes, weight-sized at an LM head; the Mosaic kernel is not
autotuned, so a step's first call needs no more memory than the next.

With ``bound`` (an int32 scalar known on the device only: the rows of a
block from which on none counts, ``rows_below``), the Mosaic GEMM runs each
product only to the rows that count; the logits past the bound are then
unspecified, the ``dhidden`` rows there zero, and the ``dweight`` and
``dbias`` sums leave them out (XLA's products are masked instead). One shape
of each product serves every number of valid rows.

With ``tile`` set, each matmul runs over the vocabulary in tiles of that many
columns. XLA:CPU computes 16-bit matmuls in float32 and converts their
operands whole: untiled, a ``[V, D]`` bfloat16 weight gets a float32 copy
(hoisted out of the chunk loop), ``dlogits`` another, and the ``dweight``
product is a fresh float32 ``[V, D]`` before it is added. Tiled, those exist
one tile at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from mst_jax import _manual_axes
from mst_jax._gemm.mosaic import gemm as mosaic_gemm
from mst_jax._math.ce import at_least_float32

WEIGHT_LAYOUTS = ("vd", "dv")

# lax.dot_general dimension numbers per weight layout.
_LOGITS_DIMS = {  # hidden [C, D] x weight -> [C, V]
  "vd": (((1,), (1,)), ((), ())),
  "dv": (((1,), (0,)), ((), ())),
}
_DHIDDEN_DIMS = {  # dlogits [C, V] x weight -> [C, D]
  "vd": (((1,), (0,)), ((), ())),
  "dv": (((1,), (1,)), ((), ())),
}
_CONTRACT_ROWS = (((0,), (0,)), ((), ()))


def vocab_axis(layout: str) -> int:
  """The weight's vocabulary axis: 0 for ``"vd"``, 1 for ``"dv"``."""
  return 0 if layout == "vd" else 1


def vocab_size(weight: jax.Array, layout: str) -> int:
  """The number of vocabulary columns ``weight`` holds."""
  return weight.shape[vocab_axis(layout)]


def weight_columns(
  weight: jax.Array, start: jax.Array, size: int, layout: str
) -> jax.Array:
  """The weight's vocabulary columns ``[start, start + size)``, either layout."""
  return lax.dynamic_slice_in_dim(weight, start, size, axis=vocab_axis(layout))


def over_columns(
  step: Callable,
  carry,
  tiled: tuple,
  width: int,
  tile: int,
  *,
  skip_first: bool = False,
  tie: bool = True,
):
  """``carry = step(carry, start, size, *tiled)`` for each tile of ``width`` columns.

  Full tiles run in a ``lax.scan``, a remainder of ``width mod tile`` columns
  once more at its own (static) width; ``skip_first`` leaves out tile 0.
  With ``tie``, ``tiled`` (the operands ``step`` slices) pass through an
  ``optimization_barrier`` with each tile's start: they then depend on the
  loop index, so XLA cannot hoist a whole-operand convert out of the loop.
  """
  barrier = lax.optimization_barrier if tie else lambda operands: operands

  def body(carry, start):
    operands, start = barrier((tiled, start))
    return step(carry, start, min(tile, width), *operands), None

  n_full, tail = divmod(width, tile) if width > tile else (1, 0)
  starts = jnp.arange(int(skip_first), n_full, dtype=jnp.int32) * tile
  carry = _manual_axes.like(carry, tiled)
  carry, _ = lax.scan(body, carry, starts)
  if tail:
    operands, start = barrier((tiled, jnp.int32(width - tail)))
    carry = step(carry, start, tail, *operands)
  return carry


def rows_below(x: jax.Array, bound: jax.Array | None, axis: int = 0) -> jax.Array:
  """``x`` with its entries from ``bound`` on along ``axis`` zeroed (a
  ``bound`` of None: ``x`` as it is)."""
  if bound is None:
    return x
  index = lax.broadcasted_iota(jnp.int32, x.shape, axis)
  return jnp.where(index < bound, x, jnp.zeros_like(x))


def _cut(bound: jax.Array | None, bounded: str) -> dict:
  """The bound arguments of a product (``_dot``'s, ``mosaic_gemm.matmul``'s):
  none without a bound."""
  return {} if bound is None else dict(bound=bound, bounded=bounded)


def _dot(
  lhs,
  rhs,
  dims,
  dtype,
  gemm: str,
  accumulate=None,
  out_shape=None,
  bound=None,
  bounded=None,
) -> jax.Array:
  """``accumulate + lax.dot_general(lhs, rhs, dims)`` written in ``dtype``
  (``accumulate`` None: the product alone), run by ``gemm``.

  ``bound`` with ``bounded`` (``mosaic_gemm.matmul``'s): ``"m"``, the
  product's rows from ``bound`` on are not needed; ``"k"``, the operands'
  contracted rows from ``bound`` on count for nothing (they may hold
  anything: XLA's product reads them zeroed).

  ``dlogits`` may be padded past the weight's columns (``padded_width``):
  then the contraction runs over the shorter operand's extent (the longer
  one's excess counts for nothing) and ``out_shape`` (default: the
  operands') trims or zero-pads the product's rows and columns.
  """
  (lc,), (rc,) = dims[0]
  kw = dict(out_shape=out_shape, zero_extend=lhs.shape[lc] != rhs.shape[rc])
  if gemm == "mosaic" and mosaic_gemm.takes(lhs, rhs, dims, dtype, accumulate, **kw):
    kw.update(_cut(bound, bounded))
    return mosaic_gemm.matmul(lhs, rhs, dims, dtype, accumulate=accumulate, **kw)
  if bounded == "k":
    lhs, rhs = rows_below(lhs, bound, lc), rows_below(rhs, bound, rc)
  k = min(lhs.shape[lc], rhs.shape[rc])
  lhs, rhs = _trim(lhs, k, lc), _trim(rhs, k, rc)
  if out_shape is not None:  # trimmed operands, then a zero-padded product
    m, n = out_shape
    lhs, rhs = _trim(lhs, m, 1 - lc), _trim(rhs, n, 1 - rc)
  product = lax.dot_general(lhs, rhs, dims, preferred_element_type=dtype)
  if out_shape is not None:
    pad = [
      (0, want - have) for want, have in zip(out_shape, product.shape, strict=True)
    ]
    product = jnp.pad(product, pad)
  return product if accumulate is None else accumulate + product


def _trim(x: jax.Array, size: int, axis: int) -> jax.Array:
  """``x``'s first ``size`` entries along ``axis`` (all of a shorter one)."""
  if x.shape[axis] <= size:
    return x
  return lax.slice_in_dim(x, 0, size, axis=axis)


PADDED_COLUMNS = 64


def padded_width(width: int) -> int:
  """The width of the logits the Mosaic kernels form for ``width`` columns:
  whole 64-column tiles, so that their 16-bit ``dlogits`` are whole
  128-byte rows, which TMA copies (float32 logits too)."""
  return -(-width // PADDED_COLUMNS) * PADDED_COLUMNS


def _write_columns(total: jax.Array, part: jax.Array, start, axis: int) -> jax.Array:
  """``total`` with ``part`` written at ``start`` along ``axis``, in place.

  The barrier keeps XLA from moving converts (XLA:CPU computes 16-bit
  elementwise ops in float32) across the update, which makes it a new
  whole-size buffer instead of an in-place write.
  """
  part, start = lax.optimization_barrier((part, start))
  return lax.dynamic_update_slice_in_dim(total, part, start, axis)


def _columns(x: jax.Array, start: jax.Array, size: int) -> jax.Array:
  """Columns ``[start, start + size)`` of a ``[rows, V]`` array."""
  return lax.dynamic_slice_in_dim(x, start, size, axis=x.ndim - 1)


def logits_matmul(
  hidden: jax.Array,
  weight: jax.Array,
  bias: jax.Array | None,
  layout: str,
  dtype: jnp.dtype | None = None,
  *,
  tile: int | None = None,
  gemm: str = "xla",
  bound: jax.Array | None = None,
) -> jax.Array:
  """``hidden @ weight (+ bias)`` in ``dtype`` (default: at least float32).

  ``dtype`` is what the matmul writes (with a bias, after adding it in float32:
  one rounding). For a narrower ``dtype`` the accumulation precision is the
  backend's: cuBLAS and XLA:CPU accumulate bfloat16 products in float32.
  Rows from ``bound`` on may be left unspecified.
  """
  if tile is not None:
    width = vocab_size(weight, layout)

    def step(logits, start, size, weight, bias, hidden):
      w = weight_columns(weight, start, size, layout)
      b = None if bias is None else lax.dynamic_slice_in_dim(bias, start, size)
      part = logits_matmul(hidden, w, b, layout, dtype)
      return _write_columns(logits, part, start, 1)

    acc = at_least_float32(hidden.dtype)
    logits = jnp.zeros((hidden.shape[0], width), dtype or acc)
    # hidden too: else its convert moves before the chunk's gather of rows
    # and is hoisted out of the chunk loop, a float32 copy of all of hidden.
    logits = over_columns(step, logits, (weight, bias, hidden), width, tile)
    # Else XLA moves a consumer's float32 convert into the tiles' writes and
    # holds the whole logits in float32.
    return lax.optimization_barrier(logits)
  acc = at_least_float32(hidden.dtype)
  dtype = dtype or acc
  cut = _cut(bound, "m")
  if bias is None:
    return _dot(hidden, weight, _LOGITS_DIMS[layout], dtype, gemm, **cut)
  logits = _dot(hidden, weight, _LOGITS_DIMS[layout], acc, gemm, **cut)
  return _add_bias(logits, bias, dtype)


def _add_bias(logits: jax.Array, bias: jax.Array, dtype) -> jax.Array:
  """``logits + bias`` (added in the logits' float32, rounded once to
  ``dtype``); logits padded past the bias's columns get zeros there."""
  bias = bias.astype(logits.dtype)
  if bias.shape[0] < logits.shape[1]:
    bias = jnp.pad(bias, (0, logits.shape[1] - bias.shape[0]))
  return (logits + bias[None, :]).astype(dtype)


def bias_gradient(dlogits: jax.Array, width: int, dtype, bound=None) -> jax.Array:
  """``dbias``'s ``width`` columns, ``dlogits`` summed over its rows (those
  before ``bound``) in ``dtype`` (``dlogits`` may be padded past them:
  ``padded_width``)."""
  return jnp.sum(rows_below(_trim(dlogits, width, 1), bound), axis=0, dtype=dtype)


def mosaic_takes_logits(
  hidden, weight, layout: str, dtype, *, bias=None, here=True
) -> bool:
  """Whether ``mosaic_logits`` forms these logits (arrays or shapes): a
  ``[D, V]`` weight needs rows of whole 128-byte TMA tiles (64 columns of
  16 bits), a ``[V, D]`` one any number of them. ``here=False``: whether it
  would on a Hopper GPU."""
  width = padded_width(vocab_size(weight, layout))
  dims, out_shape = _LOGITS_DIMS[layout], (hidden.shape[0], width)
  if bias is not None:  # the GEMM writes float32, the bias is added after
    dtype = at_least_float32(hidden.dtype)
  return mosaic_gemm.takes(hidden, weight, dims, dtype, out_shape=out_shape, here=here)


def mosaic_logits(
  hidden: jax.Array,
  weight: jax.Array,
  layout: str,
  dtype,
  row_epilogue: mosaic_gemm.RowEpilogue | None = None,
  row_inputs: tuple = (),
  *,
  bias: jax.Array | None = None,
  bound: jax.Array | None = None,
):
  """``hidden @ weight (+ bias)`` in ``dtype`` by the Mosaic GEMM,
  ``padded_width`` columns wide (the columns past the weight's are zeros),
  or None where that GEMM does not take the product (then form the logits
  with ``logits_matmul``). With a bias, the GEMM writes float32 logits and
  the bias is added to them, as ``logits_matmul`` adds it.

  With ``row_epilogue`` (not with a bias), returns ``(logits, outputs,
  part_cols)``: also the epilogue's per-row reductions of each output tile
  (computed as it is stored), each output ``[parts, rows]`` over parts of
  ``part_cols`` columns; None where the GEMM does not fuse row epilogues on
  this jaxlib (``mosaic_gemm.fuses_row_epilogues``). Rows from ``bound``
  on (of the logits and the epilogue's outputs) may be left unspecified.
  """
  dims = _LOGITS_DIMS[layout]
  out_shape = (hidden.shape[0], padded_width(vocab_size(weight, layout)))
  cut = _cut(bound, "m")
  if not mosaic_takes_logits(hidden, weight, layout, dtype, bias=bias):
    return None
  if row_epilogue is not None and not mosaic_gemm.fuses_row_epilogues():
    return None
  if bias is not None:
    if row_epilogue is not None:
      raise ValueError("a row_epilogue sees the GEMM's output, without the bias")
    acc = at_least_float32(hidden.dtype)
    logits = mosaic_gemm.matmul(hidden, weight, dims, acc, out_shape=out_shape, **cut)
    return _add_bias(logits, bias, dtype)
  if row_epilogue is None:
    return mosaic_gemm.matmul(hidden, weight, dims, dtype, out_shape=out_shape, **cut)
  config = mosaic_gemm.row_epilogue_config(
    hidden, weight, dims, dtype, row_epilogue, out_shape
  )
  logits, outputs = mosaic_gemm.matmul(
    hidden,
    weight,
    dims,
    dtype,
    config=config,
    row_epilogue=row_epilogue,
    row_inputs=row_inputs,
    out_shape=out_shape,
    **cut,
  )
  return logits, outputs, config.tile_n


def dhidden_matmul(
  dlogits: jax.Array,
  weight: jax.Array,
  layout: str,
  dtype: jnp.dtype,
  *,
  tile: int | None = None,
  gemm: str = "xla",
  bound: jax.Array | None = None,
) -> jax.Array:
  """``dlogits @ weight`` written in ``dtype`` (``dlogits`` may be padded
  past the weight's columns: ``padded_width``); rows from ``bound`` on are
  zero.

  The matmul accumulates in float32 and rounds once to ``dtype``, as the naive
  head's backward pass does; asking for a float32 result and converting would
  hold a float32 ``[rows, D]`` temporary (and, where XLA splits the long
  vocabulary contraction, several). Tiled, the tiles' products add up in a
  float32 ``[rows, D]`` accumulator.
  """
  if tile is not None:
    acc = at_least_float32(dtype)

    def step(total, start, size, dlogits, weight):
      w = weight_columns(weight, start, size, layout)
      return total + dhidden_matmul(_columns(dlogits, start, size), w, layout, acc)

    total = jnp.zeros((dlogits.shape[0], weight.shape[1 - vocab_axis(layout)]), acc)
    width = vocab_size(weight, layout)
    total = over_columns(step, total, (dlogits, weight), width, tile)
    return rows_below(total, bound).astype(dtype)
  cut = _cut(bound, "m")
  rows = _dot(dlogits, weight, _DHIDDEN_DIMS[layout], dtype, gemm, **cut)
  return rows_below(rows, bound)


def dweight_matmul(
  dlogits: jax.Array,
  hidden: jax.Array,
  layout: str,
  dtype: jnp.dtype,
  *,
  into: jax.Array | None = None,
  add: bool = True,
  tile: int | None = None,
  gemm: str = "xla",
  width: int | None = None,
  bound: jax.Array | None = None,
) -> jax.Array:
  """The weight gradient of a block of rows (those before ``bound``), in the
  weight's layout, in ``dtype``.

  With ``into`` (a weight-shaped ``dweight``), returns ``into`` plus the
  product (``add``) or the product in its place (``add=False``: ``into`` is
  a buffer whose values are never read). Tiling needs ``into``: each tile's
  columns are written into it. ``width``: the weight's vocabulary columns
  (default: ``into``'s, else ``dlogits``', which may be padded past them).
  """
  axis = vocab_axis(layout)
  if width is None:
    width = dlogits.shape[1] if into is None else into.shape[axis]
  if tile is not None and into is not None:
    dlogits = rows_below(dlogits, bound)

    def step(total, start, size, dlogits, hidden):
      part = dweight_matmul(_columns(dlogits, start, size), hidden, layout, dtype)
      if not add:
        return _write_columns(total, part, start, axis)
      if total.dtype.itemsize < 4:
        # XLA:CPU computes a 16-bit read-modify-write of a slice in float32
        # and copies the whole buffer for it; adding the zero-padded part
        # stays in place, for one pass over dweight per tile.
        zeros = jnp.zeros_like(total)
        return total + lax.dynamic_update_slice_in_dim(zeros, part, start, axis)
      part = lax.dynamic_slice_in_dim(total, start, size, axis) + part
      return _write_columns(total, part, start, axis)

    return over_columns(step, into, (dlogits, hidden), width, tile)
  # "vd": dlogits^T @ hidden -> [V, D]; "dv": hidden^T @ dlogits -> [D, V].
  operands = (dlogits, hidden) if layout == "vd" else (hidden, dlogits)
  accumulate = into if into is not None and add else None
  out_shape = None
  if width != dlogits.shape[1]:
    d = hidden.shape[1]
    out_shape = (width, d) if layout == "vd" else (d, width)
  cut = _cut(bound, "k")
  return _dot(*operands, _CONTRACT_ROWS, dtype, gemm, accumulate, out_shape, **cut)


def row_gradients(
  dlogits: jax.Array,
  hidden: jax.Array,
  weight: jax.Array,
  layout: str,
  *,
  dhidden_dtype: jnp.dtype | None,
  dweight: jax.Array | None,
  tile: int | None = None,
  gemm: str = "xla",
  bound: jax.Array | None = None,
) -> tuple[jax.Array | None, jax.Array | None]:
  """A block of rows' ``(dhidden rows, dweight)`` from its ``dlogits``.

  The rows are ``dlogits @ weight`` in ``dhidden_dtype`` (None: not formed);
  ``dweight`` gets the rows' weight gradient added, or stays None. Rows
  from ``bound`` on count for nothing (their ``dhidden`` rows are zero).
  """
  rows = None
  run = dict(tile=tile, gemm=gemm, bound=bound)
  if dhidden_dtype is not None:
    rows = dhidden_matmul(dlogits, weight, layout, dhidden_dtype, **run)
  if dweight is not None:
    dweight = dweight_matmul(
      dlogits, hidden, layout, dweight.dtype, into=dweight, **run
    )
  return rows, dweight
