"""The Mosaic GPU GEMM's epilogues: what a compute warpgroup does with a
finished ``[tile_m, tile_n]`` float32 accumulator (``_gemm.mosaic.kernels``).

``TileStore`` rounds it to the output dtype (after adding the ``accumulate``
array's tile, loaded ahead during the main loop) and stores it through
shared memory with TMA. ``RowOutputs`` runs a ``RowEpilogue`` over the tile
as stored: per-row reductions of each output tile (the cross-entropy's
statistics of a vocabulary tile of logits), written as ``[n / tile_n, m]``
arrays, so that nothing reads the output again for them.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Protocol

import jax
import jax.numpy as jnp

from mst_jax._gemm.mosaic.config import GemmConfig, Problem, epilogue_slots

try:  # Mosaic GPU's Pallas front end; its lowering runs only on a Hopper GPU.
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover -- a jax without Mosaic GPU
  pl = plgpu = None


def load_rows(ref, axis: int = 1):
  """A ``[rows]`` shared-memory vector, loaded in the layout of a wgmma
  accumulator's rows (``WGMMA.reduce(1)``); with ``axis=0``, a ``[columns]``
  one in that of its columns."""
  layout = plgpu.Layout.WGMMA.reduce(axis)
  if _load_takes_an_index():
    return plgpu.load(ref, (), layout=layout)
  return plgpu.load(ref, layout=layout)


@functools.cache
def _load_takes_an_index() -> bool:
  """Whether ``plgpu.load`` needs its index argument: jax 0.10's does; jax
  0.11 deprecates it (index the ref instead), and a ref loaded whole needs
  none."""
  index = inspect.signature(plgpu.load).parameters.get("idx")
  return index is not None and index.default is inspect.Parameter.empty


class RowEpilogue(Protocol):
  """Per-row reductions of each output tile, in the GEMM's epilogue.

  A hashable (frozen dataclass) value: it is a static argument of the GEMM.

  Attributes:
    input_dtypes: dtypes of the ``[m]`` row inputs (e.g. the labels), loaded
      for each tile's rows.
    out_dtypes: dtypes of the ``[tile_m]`` row outputs.
    approx_math: whether the kernel may take Mosaic GPU's approximate math.
  """

  input_dtypes: tuple
  out_dtypes: tuple
  approx_math: bool

  def __call__(self, tile: jax.Array, first_col, inputs: list) -> list:
    """The rows' outputs of ``tile`` (``[tile_m, tile_n]`` in the output
    dtype, as stored), whose first column is ``first_col`` of the output;
    ``inputs``: the rows' values of each row input (``[tile_m]``)."""
    ...


def smem_transforms(minor_elements: int, dtype, tile_rows: int = 8) -> tuple:
  """Tiling and swizzle of a shared-memory tile ``minor_elements`` wide, in
  tiles of ``tile_rows`` rows of one swizzle span each."""
  bits = jnp.dtype(dtype).itemsize * 8
  swizzle = plgpu.find_swizzle(minor_elements * bits)
  tiling = plgpu.TilingTransform((tile_rows, swizzle * 8 // bits))
  return tiling, plgpu.SwizzleTransform(swizzle)


def smem(shape, dtype, ragged: bool = False):
  """A shared-memory buffer of tiles ``shape[-1]`` wide, for wgmma and TMA.

  ``ragged``: the buffer copies an array whose number of rows is not a
  multiple of 8, which TMA takes only in tiles of one row. Then it is a
  union of two views of the same bytes: tiled by 8 rows (for wgmma and the
  registers) and by one row (for TMA), alike where the tile is one swizzle
  span wide (``_gemm.mosaic.config.ragged_error``). Returns the allocation;
  ``views`` gives ``(compute view, copy view)`` of it in a kernel.
  """
  transforms = smem_transforms(shape[-1], dtype)
  tiles = plgpu.SMEM(shape, dtype, transforms=transforms)
  if not ragged:
    return tiles
  rows = plgpu.SMEM(shape, dtype, transforms=smem_transforms(shape[-1], dtype, 1))
  return plgpu.RefUnion(tiles, rows)


def views(buffer, ragged: bool = False) -> tuple:
  """``(compute view, copy view)`` of a buffer ``smem`` allocated."""
  return tuple(buffer) if ragged else (buffer, buffer)


def out_smem(config: GemmConfig, out_dtype, ragged: bool = False):
  """Each compute warpgroup's epilogue staging slots (``smem``)."""
  shape = (2, epilogue_slots(config), config.epilogue_m, config.epilogue_n)
  return smem(shape, out_dtype, ragged)


def _pieces(c: GemmConfig) -> list[tuple[slice, slice]]:
  """A warpgroup tile's ``[epilogue_m, epilogue_n]`` pieces, in store order."""
  em, en = c.epilogue_m, c.epilogue_n
  return [
    (slice(i * em, (i + 1) * em), slice(j * en, (j + 1) * en))
    for i in range(c.tile_m // em)
    for j in range(c.tile_n // en)
  ]


@dataclasses.dataclass(frozen=True)
class TileStore:
  """The epilogue of one warpgroup's ``[tile_m, tile_n]`` output tile.

  Pieces go through the warpgroup's shared-memory slots by TMA (rows and
  columns past the array's end are read as zeros and not written), copied
  through ``tma_smem``: the slots' copy view (``views``; the slots
  themselves unless the output is ragged). With
  ``accumulate``, each piece's addend is loaded into its slot ahead of time:
  the first ``slots`` during the main loop, each later one as soon as the
  store before it in its slot has read the slot.
  """

  out_tile: object  # GMEM [tile_m, tile_n] view
  out_smem: object  # SMEM [slots, epilogue_m, epilogue_n]
  load_barrier: object  # [2 * slots] barriers, or None
  wg: jax.Array
  p: Problem
  c: GemmConfig
  tma_smem: object  # out_smem's copy view (``views``)

  def begin(self) -> None:
    """Before the main loop: the slots' last stores have read them; the
    addend's first pieces are loaded (they arrive during the loop)."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    if self.p.accumulate:
      for index in range(min(epilogue_slots(self.c), len(_pieces(self.c)))):
        self.load_addend(index)

  def _slot(self, index: int) -> tuple[int, object]:
    slot = index % epilogue_slots(self.c)
    return slot, self.load_barrier.at[self.wg * epilogue_slots(self.c) + slot]

  def load_addend(self, index: int) -> None:
    rows, cols = _pieces(self.c)[index]
    slot, barrier = self._slot(index)
    plgpu.copy_gmem_to_smem(
      self.out_tile.at[rows, cols], self.tma_smem.at[slot], barrier
    )

  def store(self, acc: jax.Array) -> None:
    """Stores ``acc`` (float32, or already in the output dtype)."""
    pieces, slots = _pieces(self.c), epilogue_slots(self.c)
    for index, (rows, cols) in enumerate(pieces):
      slot = index % slots
      piece = acc[rows, cols]  # [epilogue_m, epilogue_n]
      if self.p.accumulate:
        plgpu.barrier_wait(self._slot(index)[1])
        piece = piece + self.out_smem[slot].astype(jnp.float32)
      else:
        plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
      self.out_smem[slot] = piece.astype(self.p.out_dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(self.tma_smem.at[slot], self.out_tile.at[rows, cols])
      if self.p.accumulate and index + slots < len(pieces):
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # this store read the slot
        self.load_addend(index + slots)


def row_scratch(epilogue: RowEpilogue | None, config: GemmConfig) -> dict:
  """``pl.run_scoped`` allocations of ``RowOutputs``: per compute
  warpgroup, a ``[tile_m]`` buffer of each row input and output, and a
  barrier per input."""
  if epilogue is None:
    return {"row_in": None, "row_out": None, "row_barrier": None}
  buffer = lambda dtype: plgpu.SMEM((2, config.tile_m), dtype)
  return {
    "row_in": [buffer(d) for d in epilogue.input_dtypes],
    "row_out": [buffer(d) for d in epilogue.out_dtypes],
    "row_barrier": plgpu.Barrier(num_barriers=2 * len(epilogue.input_dtypes)),
  }


@dataclasses.dataclass(frozen=True)
class RowOutputs:
  """A ``RowEpilogue`` in one warpgroup's epilogue: its inputs loaded (by
  TMA, during the main loop) for the tile's rows, its outputs written into
  row ``cols.start // tile_n`` of the ``[n / tile_n, m]`` outputs (rows past
  ``m`` are dropped)."""

  epilogue: RowEpilogue
  inputs: list  # GMEM [m] refs
  outputs: list  # GMEM [n / tile_n, m] refs
  scratch: dict  # row_scratch's, allocated
  wg: jax.Array
  c: GemmConfig

  def begin(self, rows) -> None:
    """Before the main loop: loads the inputs' ``rows`` (the last tile's
    outputs have been read: ``TileStore.begin`` waited for every store)."""
    n = len(self.inputs)
    buffers = self.scratch["row_in"]
    for index, (ref, buffer) in enumerate(zip(self.inputs, buffers, strict=True)):
      barrier = self.scratch["row_barrier"].at[self.wg * n + index]
      plgpu.copy_gmem_to_smem(ref.at[rows], buffer.at[self.wg], barrier)

  def finish(self, tile: jax.Array, rows, cols) -> None:
    """Runs the epilogue over ``tile`` and stores its outputs."""
    n = len(self.inputs)
    values = []
    for index, buffer in enumerate(self.scratch["row_in"]):
      plgpu.barrier_wait(self.scratch["row_barrier"].at[self.wg * n + index])
      values.append(load_rows(buffer.at[self.wg]))
    results = self.epilogue(tile, cols.start, values)
    part = cols.start // self.c.tile_n
    buffers = self.scratch["row_out"]
    for ref, buffer, value in zip(self.outputs, buffers, results, strict=True):
      buffer.at[self.wg][...] = value
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(buffer.at[self.wg], ref.at[part, rows])


def pad_rows(x: jax.Array, config: GemmConfig) -> jax.Array:
  """A ``[m]`` row input padded to whole ``tile_m`` blocks (TMA moves them whole)."""
  return jnp.pad(x, (0, -x.shape[0] % config.tile_m))


def row_out_types(epilogue: RowEpilogue, problem: Problem, config: GemmConfig):
  """Shapes of the row outputs, ``[n / tile_n, m]`` padded to whole row blocks."""
  parts = pl.cdiv(problem.n, config.tile_n)
  rows = pl.cdiv(problem.m, config.tile_m) * config.tile_m
  return [jax.ShapeDtypeStruct((parts, rows), d) for d in epilogue.out_dtypes]
