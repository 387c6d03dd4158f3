"""The LM head's GEMMs as one Mosaic GPU kernel for Hopper (sm_90a).

``matmul`` computes ``lax.dot_general(lhs, rhs, dimension_numbers,
preferred_element_type=out_dtype)`` for 2-D operands contracted over one
dimension each, which covers the head's three products in both weight layouts
(``mst_jax._gemm.matmul``): an operand contracted over its rows is read as
transposed shared-memory tiles (wgmma's transpose bits), so the weight is
never transposed or copied in device memory.

The kernels (``mst_jax._gemm.mosaic.kernels``) run a persistent grid of
warp-specialized blocks: a warpgroup issuing TMA copies into a ring of
shared-memory slots, two issuing ``wgmma``, either both on each output tile
or (ping-pong) each on its own tiles in turn; ``default_config`` picks the
tiles and the schedule per shape. A ping-pong product may also run a
``RowEpilogue`` (``_gemm.mosaic.epilogue``): per-row reductions of each
output tile as it is stored, such as the cross-entropy's statistics of the
logits.

Sizes need not be multiples of the tiles: TMA fills reads past an array's end
with zeros (adding nothing to a dot product) and drops writes past it. Mosaic
GPU describes each array to TMA in shared-memory tiles of 128-byte rows, so
every operand and the output must have a multiple of 64 (16-bit) or 32
(float32) columns as stored: V = 32000, 128256 or 256000 qualify as columns,
GPT-2's 50257 does not. An array whose number of rows is not a multiple of 8
(a ``[50257, D]`` weight; ``Problem.ragged``) is copied in tiles of one row
(``_gemm.mosaic.config.ragged_error``); an operand contracted over its rows
must have whole tiles of 8 of them. An output one swizzle span wide (a
16-bit ``[V, 64]`` ``dweight``) is stored from blocks as narrow
(``_gemm.mosaic.config.narrow_error``). ``matmul`` raises
``NotImplementedError`` for other shapes. For logits padded past a ragged
vocabulary, ``out_shape`` makes the product wider or narrower than the
operands (zeros past them, the rest dropped), and ``zero_extend`` contracts
operands of different lengths (the shorter read as zero-extended).

The module imports on any jax (a missing Mosaic GPU is reported when
``matmul`` is called); without a Hopper GPU ``matmul`` raises
``NotImplementedError``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import jaxlib

from mst_jax._gemm.mosaic.config import (
  GemmConfig,
  Problem,
  accumulator_limit,
  default_config,
  fit_narrow,
  fit_ragged,
  fit_shared_memory,
  relocatable_ptx,
)
from mst_jax._gemm.mosaic.epilogue import RowEpilogue
from mst_jax._gemm.mosaic.kernels import IMPORT_ERROR, gemm

_INPUT_DTYPES = ("bfloat16", "float16")
_OUTPUT_DTYPES = ("bfloat16", "float16", "float32")
_SWIZZLE_BYTES = 128  # shared-memory tiles are 8 rows of 128 swizzled bytes
_TILE_ROWS = 8


def _check(
  lhs, rhs, dimension_numbers, out_dtype, accumulate, out_shape=None, zero_extend=False
) -> Problem:
  """Validates the arguments at trace time; returns the problem they pose."""
  (lhs_contract, rhs_contract), batch = dimension_numbers
  if lhs.ndim != 2 or rhs.ndim != 2 or any(batch):
    raise NotImplementedError(
      f"mosaic_gemm.matmul takes 2-D operands without batch dimensions, got"
      f" {lhs.shape} x {rhs.shape} with {dimension_numbers}; use lax.dot_general."
    )
  if len(lhs_contract) != 1 or len(rhs_contract) != 1:
    raise ValueError(f"contract one dimension of each operand, got {dimension_numbers}")
  (lc,), (rc,) = lhs_contract, rhs_contract
  if lhs.shape[lc] != rhs.shape[rc] and not zero_extend:
    raise ValueError(
      f"contracted dimensions differ: {lhs.shape}[{lc}] vs {rhs.shape}[{rc}]"
    )
  if jnp.dtype(lhs.dtype).name not in _INPUT_DTYPES or rhs.dtype != lhs.dtype:
    raise TypeError(
      f"operands must be bfloat16 or float16, got {lhs.dtype}, {rhs.dtype}"
    )
  out_dtype = jnp.dtype(out_dtype)
  if out_dtype.name not in _OUTPUT_DTYPES:
    raise TypeError(f"out_dtype must be one of {_OUTPUT_DTYPES}, got {out_dtype}")
  k = max(lhs.shape[lc], rhs.shape[rc])
  m, n = out_shape or (lhs.shape[1 - lc], rhs.shape[1 - rc])
  if accumulate is not None:
    if accumulate.shape != (m, n):
      raise ValueError(
        f"accumulate has shape {accumulate.shape}, the product ({m}, {n})"
      )
    if accumulate.dtype != out_dtype:
      raise TypeError(f"accumulate is {accumulate.dtype}, out_dtype {out_dtype}")
  ragged = []
  for name, shape, dtype in (
    ("lhs", lhs.shape, lhs.dtype),
    ("rhs", rhs.shape, rhs.dtype),
    ("output", (m, n), out_dtype),
  ):
    row_elements = _SWIZZLE_BYTES // jnp.dtype(dtype).itemsize
    if shape[1] % row_elements:
      raise NotImplementedError(
        f"mosaic_gemm.matmul: the {name} {shape} ({jnp.dtype(dtype).name}) has rows"
        f" of other than whole {_SWIZZLE_BYTES}-byte tiles ({row_elements} j"
        " elements), which TMA cannot copy; use lax.dot_general."
      )
    ragged.append(shape[0] % _TILE_ROWS != 0)
  if ragged[0] and lc == 0:
    raise NotImplementedError(
      f"mosaic_gemm.matmul: the lhs {lhs.shape} is contracted over a number of"
      f" rows that is not a multiple of {_TILE_ROWS}; use lax.dot_general."
    )
  in_dtype, has_accumulate = jnp.dtype(lhs.dtype), accumulate is not None
  return Problem(
    m, n, k, lc == 0, rc == 1, in_dtype, out_dtype, has_accumulate, tuple(ragged)
  )


def fuses_row_epilogues() -> bool:
  """Whether the head's logits take their row epilogue (the cross-entropy's
  statistics) in the GEMM on this jaxlib: not from 0.12 (``relocatable_ptx``),
  where the ping-pong schedule a row epilogue needs holds only 128 x 128
  tiles. There the Llama-3 head's logits with the statistics epilogue took
  21.4 ms, a cooperative GEMM 11.9 ms and a statistics kernel over its
  output 0.93 ms (H100, jax 0.12.0.1)."""
  return not relocatable_ptx(jaxlib.__version__)


def _accumulator() -> int:
  return accumulator_limit(jaxlib.__version__)


def _num_sms() -> int:
  return getattr(jax.devices()[0], "core_count", None) or 132


def _config(p: Problem, row_epilogue: RowEpilogue | None = None) -> GemmConfig:
  """The default config of ``p``, fitted to its ragged arrays."""
  vectors = None
  if row_epilogue is not None:
    vectors = len(row_epilogue.input_dtypes) + len(row_epilogue.out_dtypes)
  config = default_config(
    p.m, p.n, p.k, p.out_dtype, p.accumulate, _num_sms(), vectors, _accumulator()
  )
  config = fit_narrow(fit_ragged(config, p), p)
  return fit_shared_memory(config, p.out_dtype, p.accumulate, vectors)


def row_epilogue_config(
  lhs, rhs, dimension_numbers, out_dtype, row_epilogue: RowEpilogue, out_shape=None
) -> GemmConfig:
  """The config ``matmul`` runs ``row_epilogue`` with by default: its row
  outputs' parts are ``tile_n`` columns wide."""
  problem = _check(lhs, rhs, dimension_numbers, out_dtype, None, out_shape)
  return _config(problem, row_epilogue)


VMAP_ERROR = (
  "mst_jax: the Mosaic GPU kernels (impl='mosaic', the default on a Hopper GPU)"
  " have no batching rule, so they do not run under jax.vmap; pass"
  " impl='pallas', or put the batch axis into the rows (a [B, T, D] hidden)."
)


def unbatched(fn):
  """``fn`` (of arrays), which raises ``NotImplementedError(VMAP_ERROR)``
  under ``jax.vmap`` instead of Pallas's own error (Mosaic GPU kernels have
  no batching rule)."""
  fn = jax.custom_batching.custom_vmap(fn)

  @fn.def_vmap
  def _rule(axis_size, in_batched, *args):
    raise NotImplementedError(VMAP_ERROR)

  return fn


_STATIC_ARGS = (
  "dimension_numbers",
  "out_dtype",
  "config",
  "row_epilogue",
  "out_shape",
  "zero_extend",
  "bounded",
)
BOUNDED = (None, "m", "k")


@functools.cache
def unavailable_reason() -> str | None:
  """Why the kernel cannot run on the default device, or None."""
  if IMPORT_ERROR is not None:
    return f"jax.experimental.pallas.mosaic_gpu is not importable ({IMPORT_ERROR})"
  device = jax.devices()[0]
  if device.platform != "gpu":
    return f"it needs a Hopper GPU, the default device is a {device.platform}"
  capability = getattr(device, "compute_capability", None)
  if capability != "9.0":
    return f"it needs a Hopper GPU (compute capability 9.0), got {capability}"
  return None


def takes(
  lhs, rhs, dimension_numbers, out_dtype, accumulate=None, *, here=True, **shapes
) -> bool:
  """Whether ``matmul`` runs these arguments here (a Hopper GPU, bf16/f16
  operands, arrays of whole 128-byte rows); ``mst_jax._gemm.matmul`` uses
  ``lax.dot_general`` for the rest. ``shapes``: ``matmul``'s ``out_shape``
  and ``zero_extend``. ``here=False``: whether it would on a Hopper GPU
  (the shapes and dtypes alone)."""
  if here and unavailable_reason() is not None:
    return False
  try:
    _check(lhs, rhs, dimension_numbers, out_dtype, accumulate, **shapes)
  except (NotImplementedError, TypeError, ValueError):
    return False
  return True


@functools.partial(jax.jit, static_argnames=_STATIC_ARGS)
def matmul(
  lhs: jax.Array,
  rhs: jax.Array,
  dimension_numbers,
  out_dtype=None,
  *,
  accumulate: jax.Array | None = None,
  config: GemmConfig | None = None,
  row_epilogue: RowEpilogue | None = None,
  row_inputs: tuple = (),
  out_shape: tuple[int, int] | None = None,
  zero_extend: bool = False,
  bound: jax.Array | None = None,
  bounded: str | None = None,
):
  """``lax.dot_general(lhs, rhs, dimension_numbers)`` (2-D) on Hopper's wgmma.

  Accumulates in float32 and rounds once to ``out_dtype``. Either operand may
  be contracted over its rows or its columns; neither is transposed in
  memory. The LM head's products, for ``hidden [N, D]``, ``dlogits [N, V]``
  and a weight ``[V, D]`` (``"vd"``) or ``[D, V]`` (``"dv"``), are those of
  ``mst_jax._gemm.matmul``::

    logits  = matmul(hidden, w, (((1,), (1,)), ((), ())), bf16)    # vd
    logits  = matmul(hidden, w, (((1,), (0,)), ((), ())), bf16)    # dv
    dhidden = matmul(dlogits, w, (((1,), (0,)), ((), ())), bf16)   # vd
    dhidden = matmul(dlogits, w, (((1,), (1,)), ((), ())), bf16)   # dv
    dweight = matmul(dlogits, hidden, (((0,), (0,)), ((), ())), f32,
                     accumulate=dweight)                          # vd
    dweight = matmul(hidden, dlogits, (((0,), (0,)), ((), ())), f32,
                     accumulate=dweight)                          # dv

  Args:
    lhs: ``[M, K]``, or ``[K, M]`` when contracted over dimension 0;
      bfloat16 or float16.
    rhs: ``[K, N]``, or ``[N, K]`` when contracted over dimension 1; the
      dtype of ``lhs``.
    dimension_numbers: ``(((lhs_dim,), (rhs_dim,)), ((), ()))`` as for
      ``lax.dot_general``.
    out_dtype: bfloat16, float16 or float32 (default: ``accumulate``'s dtype,
      else the inputs').
    accumulate: ``[M, N]`` in ``out_dtype`` or None; the result is
      ``accumulate + lhs @ rhs``, each tile read and rewritten by the kernel
      (in place when the caller no longer needs ``accumulate``: XLA aliases
      it with the result).
    config: tiles and pipelining (default: ``default_config``).
    row_epilogue: per-row reductions of each ``[tile_m, tile_n]`` output
      tile as stored, computed in the kernel's epilogue (``RowEpilogue``;
      not with ``accumulate``); the config must then be ping-pong
      (``split="tiles"``) and unsplit.
    row_inputs: ``row_epilogue``'s ``[M]`` row inputs.
    out_shape: the output's ``(M, N)`` (default: the operands'): columns
      past ``rhs``'s ``N`` or rows past ``lhs``'s ``M`` are zeros; fewer are
      the product's first ones.
    zero_extend: contract operands whose contracted dimensions differ, the
      shorter read as zero-extended (else they must agree).
    bound: an int32 scalar, known on the device only, with ``bounded``:
      ``"m"``: the output's rows from ``bound`` on (from the first block of
      rows starting there) are not computed, and hold unspecified values;
      ``"k"``: the contraction stops at the first multiple of ``tile_k``
      (64) at or past ``bound``, so the operands' rows or columns past it are
      never read. A masked group of rows (valid rows first) runs its
      products once, at one shape, to the rows that count.

  Returns:
    ``[M, N]`` in ``out_dtype``; with ``row_epilogue``, also a list of its
    outputs, each ``[cdiv(N, tile_n), M]``: row ``j`` of the output columns
    ``j tile_n`` to ``(j + 1) tile_n``.

  Raises:
    ValueError: shapes that do not contract, or ``accumulate`` of another shape.
    TypeError: dtypes other than those above.
    NotImplementedError: no Hopper GPU, batch dimensions, or arrays that are
      not whole 128-byte rows (see the module docstring).
  """
  if out_dtype is None:
    out_dtype = lhs.dtype if accumulate is None else accumulate.dtype
  problem = _check(
    lhs, rhs, dimension_numbers, out_dtype, accumulate, out_shape, zero_extend
  )
  if bounded not in BOUNDED or (bound is None) != (bounded is None):
    raise ValueError(
      f"bounded must be one of {BOUNDED}, given with a bound; got {bounded!r}"
      f" with bound {bound!r}"
    )
  if (reason := unavailable_reason()) is not None:
    raise NotImplementedError(f"mosaic_gemm.matmul: {reason}; use lax.dot_general.")
  p = problem = dataclasses.replace(problem, bounded=bounded)
  if row_epilogue is None:
    config = config or _config(p)
    if accumulate is not None:  # (a Ref inside: no custom_vmap around it)
      return gemm(lhs, rhs, accumulate, problem, config, _num_sms(), bound=bound)
    run = lambda lhs, rhs, *bound: gemm(
      lhs, rhs, None, problem, config, _num_sms(), bound=(bound or (None,))[0]
    )
    return unbatched(run)(lhs, rhs, *_bound_args(bound))
  if accumulate is not None:
    raise ValueError("a row_epilogue does not run with accumulate")
  if len(row_inputs) != len(row_epilogue.input_dtypes) or any(
    x.shape != (p.m,) for x in row_inputs
  ):
    raise ValueError(
      f"row_inputs must be {len(row_epilogue.input_dtypes)} arrays of shape"
      f" ({p.m},), got {[x.shape for x in row_inputs]}"
    )
  config = config or _config(p, row_epilogue)

  inputs = len(row_inputs)

  def run(lhs, rhs, *args):
    rows = (row_epilogue, list(args[:inputs]))
    bound = (args[inputs:] or (None,))[0]
    return gemm(lhs, rhs, None, problem, config, _num_sms(), rows=rows, bound=bound)

  return unbatched(run)(lhs, rhs, *row_inputs, *_bound_args(bound))


def _bound_args(bound) -> tuple:
  """``(bound,)`` as an int32 array, or ``()``: an argument of the kernels'
  functions, not a constant they close over."""
  return () if bound is None else (jnp.asarray(bound, jnp.int32),)
