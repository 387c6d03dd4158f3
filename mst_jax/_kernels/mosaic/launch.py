"""Where the Mosaic GPU cross-entropy and distillation kernels run
(``mosaic.ce``, ``mosaic.distill``): their tiles, a grid of row blocks by
vocabulary parts over ``[R, V]`` arrays (16-bit or float32), what a program
reads and writes (``Program``), and ``launch``.

TMA moves whole shared-memory tiles of 8 rows x 128 bytes, so the kernels
take arrays of ``8 i`` rows and ``64 j`` columns (``32 j`` in float32:
``takes``); rows and columns past the array's ends are read as zeros and
not written. On a Hopper
GPU the kernels launch with ``pl.kernel``; in interpret mode (a CPU) they
run through ``pallas_call`` instead, on arrays padded to whole parts of whole
tiles, which each program reads and writes directly: the same bodies,
without TMA or shared memory.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from mst_jax._gemm.mosaic.epilogue import load_rows

try:  # Mosaic GPU's Pallas front end (lowering needs a Hopper GPU)
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover -- a jax without Mosaic GPU
  plgpu = None

_TILE_ROWS, _TILE_BYTES = 8, 128  # what TMA moves: 8 rows of 128 bytes


@dataclasses.dataclass(frozen=True)
class MosaicBlocks:
  """Tiles of the Mosaic GPU cross-entropy kernels.

  Attributes:
    block_rows: rows per program, a multiple of 64 (a warpgroup's rows).
    block_v: vocabulary columns per tile, a multiple of 64.
    stages: tiles in flight per program (TMA runs this far ahead).
    programs: the kernels cut the vocabulary into parts until row blocks
      times parts reaches this (several per SM, whose warps hide each
      other's latency).
  """

  block_rows: int = 64
  block_v: int = 128
  stages: int = 2
  programs: int = 1056

  def __post_init__(self) -> None:
    for name, multiple in (("block_rows", 64), ("block_v", 64)):
      value = getattr(self, name)
      if not (isinstance(value, int) and value > 0 and value % multiple == 0):
        raise ValueError(f"MosaicBlocks.{name} must be a multiple of {multiple}.")
    for name in ("stages", "programs"):
      if not (isinstance(value := getattr(self, name), int) and value >= 1):
        raise ValueError(f"MosaicBlocks.{name} must be >= 1, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class Grid:
  """Row blocks x vocabulary parts x tiles per part."""

  row_blocks: int
  parts: int
  steps: int

  @classmethod
  def of(cls, n_rows: int, n_cols: int, blocks: MosaicBlocks) -> Grid:
    row_blocks = pl.cdiv(n_rows, blocks.block_rows)
    tiles = pl.cdiv(n_cols, blocks.block_v)
    parts = min(tiles, max(1, pl.cdiv(blocks.programs, row_blocks)))
    steps = pl.cdiv(tiles, parts)
    return cls(row_blocks, pl.cdiv(tiles, steps), steps)


@dataclasses.dataclass(frozen=True)
class Program:
  """What a kernel body needs of where it runs: its program's indices, its
  rows of the ``[R]`` row vectors, and the walk over its tiles.

  On a GPU (``pl.kernel``) row vectors go through shared memory by TMA and
  tiles through a TMA pipeline; in interpret mode (``pallas_call``) arrays
  padded to whole parts of whole tiles are read and written directly.
  """

  grid: Grid
  blocks: MosaicBlocks
  interpret: bool
  shift: Any = None  # in the kernel: a [1] int32 ref, written tiles' row offset

  def index(self):
    """``(row block, part)``."""
    if self.interpret:
      return pl.program_id(0), pl.program_id(1)
    return lax.axis_index("rows"), lax.axis_index("parts")

  def _rows(self):
    return pl.ds(self.index()[0] * self.blocks.block_rows, self.blocks.block_rows)

  def with_rows(self, refs, body):
    """``body(values)`` with the program's rows of each ``[R]`` ref."""
    if self.interpret:
      return body([ref[self._rows()] for ref in refs])
    rows, n = self.blocks.block_rows, len(refs)

    def scoped(*scratch):
      *buffers, barriers = scratch
      for k, (ref, buffer) in enumerate(zip(refs, buffers, strict=True)):
        plgpu.copy_gmem_to_smem(ref.at[self._rows()], buffer, barriers.at[k])
      values = []
      for k, buffer in enumerate(buffers):
        plgpu.barrier_wait(barriers.at[k])
        values.append(load_rows(buffer))
      return body(values)

    smem = [plgpu.SMEM((rows,), ref.dtype) for ref in refs]
    return pl.run_scoped(scoped, *smem, plgpu.Barrier(num_barriers=n))

  def store_rows(self, refs, values) -> None:
    """Writes each value into the program's part and rows of a ``[parts, R]`` ref."""
    part = self.index()[1]
    if self.interpret:
      for ref, value in zip(refs, values, strict=True):
        ref[part, self._rows()] = value
      return

    def scoped(*buffers):
      for ref, buffer, value in zip(refs, buffers, values, strict=True):
        buffer[...] = value
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(buffer, ref.at[part, self._rows()])
      plgpu.wait_smem_to_gmem(0)

    rows = self.blocks.block_rows
    pl.run_scoped(scoped, *[plgpu.SMEM((rows,), v.dtype) for v in values])

  def columns(self, ref):
    """A walk's ``[block_v]`` tile of a ``[V]`` ref, loaded."""
    return ref[...] if self.interpret else load_rows(ref, axis=0)

  def walk(self, body, ins, outs=(), *, init=None):
    """Runs ``body(col, *in_tiles, *out_tiles[, carry])`` over the program's
    tiles of the ``[R, V]`` refs ``ins`` and ``outs`` (``col``: the tile's
    first column; with ``shift``, ``outs`` are written that many row blocks
    further down); returns the carry. A ``[V]`` ref in ``ins`` gives the
    tiles' columns of it (``columns`` loads them)."""
    rows, cols = self.blocks.block_rows, self.blocks.block_v
    row_block, part = self.index()
    out_block = row_block if self.shift is None else row_block + self.shift[0]
    tile_index = lambda step, row=row_block: (row, part * self.grid.steps + step)
    out_index = functools.partial(tile_index, row=out_block)
    column_index = lambda step: tile_index(step)[1:]
    tile_body = lambda index, *args: body(tile_index(index[0])[1] * cols, *args)
    index_of = lambda ref: tile_index if ref.ndim == 2 else column_index
    if self.interpret:

      def step(index, carry):
        window = lambda at: tuple(
          pl.ds(i * size, size)
          for i, size in zip(at, (rows, cols)[-len(at) :], strict=True)
        )
        tiles = [ref.at[window(index_of(ref)(index))] for ref in ins]
        tiles += [ref.at[window(out_index(index))] for ref in outs]
        if init is None:
          tile_body((index,), *tiles)
          return carry
        return tile_body((index,), *tiles, carry)

      return lax.fori_loop(0, self.grid.steps, step, init)

    def spec(ref, index):
      if ref.ndim == 1:  # a [V] vector's columns, in one TMA copy
        return plgpu.BlockSpec((cols,), column_index)
      bits = jnp.dtype(ref.dtype).itemsize * 8
      swizzle = plgpu.find_swizzle(cols * bits)
      transforms = (
        plgpu.TilingTransform((_TILE_ROWS, swizzle * 8 // bits)),
        plgpu.SwizzleTransform(swizzle),
      )
      return plgpu.BlockSpec((rows, cols), index, transforms=transforms)

    return plgpu.emit_pipeline(
      tile_body,
      grid=(self.grid.steps,),
      in_specs=[spec(ref, tile_index) for ref in ins],
      out_specs=[spec(ref, out_index) for ref in outs],
      max_concurrent_steps=self.blocks.stages,
      init_carry=init,
    )(*ins, *outs)


def launch(
  kernel,
  name,
  grid,
  rows,
  out_type,
  arrays,
  *,
  tiles,
  interpret,
  approx,
  new=None,
  at_row=None,
  columns=(),
  bound=None,
):
  """``kernel(..., program=)`` over ``grid``'s ``(row blocks, parts)``.

  ``rows``: ``[R]`` arrays; ``arrays``: ``[R, V]`` arrays of one shape.
  ``out_type``: ``[parts, R]`` outputs, and the kernel takes
  ``(*arrays, *rows, *outputs)``. With ``out_type=None`` the kernel writes
  ``[R, V]`` tiles and takes ``(*rows, *arrays)``: over the last of
  ``arrays``, a ``jax.Ref``, or with ``new`` (a dtype) into a new array of
  that dtype, the kernel's last argument. With ``at_row`` (a row of whole
  row blocks, traced or not) that ``jax.Ref`` has more rows, and the kernel
  writes its rows ``at_row:at_row + R`` (``Program.shift``; ``R`` whole row
  blocks, nothing written past them). Row vectors and per-part outputs
  are padded to whole row blocks (the kernels move them whole, by TMA,
  between device and shared memory). ``columns``: ``[V]`` vectors (class
  weights), which the kernel takes after the row vectors and walks beside
  the arrays' tiles (padded with zeros to whole parts of whole tiles).
  ``bound`` (an int32 scalar, traced or not): on a GPU the programs of the
  row blocks from it on do nothing, so their rows are left as they were
  (outputs and a new array unspecified there); interpreted, all run (Pallas
  interprets no program index inside a conditional).
  Returns the outputs, the new array, or None.
  """
  assert new is None or out_type is None, "a new array is written, not outputs"
  n_rows, n_cols = arrays[0].shape
  program = Program(grid, tiles, interpret)
  body = functools.partial(kernel, program=program)
  padded_rows = grid.row_blocks * tiles.block_rows
  rows = [jnp.pad(r, (0, padded_rows - n_rows)) for r in rows]
  padded_cols = grid.parts * grid.steps * tiles.block_v
  rows += [jnp.pad(c, (0, padded_cols - c.shape[0])) for c in columns]
  written = out_type is None
  if at_row is not None:  # a [1] int32 argument before the others
    assert written and new is None and n_rows == padded_rows, "whole row blocks"
    shift = jnp.asarray(at_row, jnp.int32).reshape(1) // tiles.block_rows
    shifted = lambda ref: dataclasses.replace(program, shift=ref)
    body = lambda shift_ref, *refs: kernel(*refs, program=shifted(shift_ref))
    rows = [shift, *rows]
  if bound is not None and not interpret:  # a [1] int32 before the row vectors
    at = 0 if written else len(arrays)
    body = functools.partial(_below, body, at, program, tiles.block_rows)
    rows = [jnp.asarray(bound, jnp.int32).reshape(1), *rows]
  if new is not None:
    out_type = jax.ShapeDtypeStruct((n_rows, n_cols), new)
  elif not written:
    out_type = [
      jax.ShapeDtypeStruct((o.shape[0], padded_rows), o.dtype) for o in out_type
    ]
  if not interpret:
    outputs = pl.kernel(
      body,
      out_type=() if written and new is None else out_type,
      mesh=plgpu.Mesh(grid=(grid.row_blocks, grid.parts), grid_names=("rows", "parts")),
      compiler_params=plgpu.CompilerParams(
        approx_math=approx, lowering_semantics=plgpu.LoweringSemantics.Warpgroup
      ),
      name=name,
    )(*((*rows, *arrays) if written else (*arrays, *rows)))
    if written:
      return outputs if new is not None else None
    return [o[:, :n_rows] for o in outputs]
  # Interpret mode: the arrays padded too (TMA reads zeros past the ends and
  # drops writes there); the written one is an output aliased to its input.
  pad = lambda a: (
    (0, max(padded_rows, a.shape[0]) - a.shape[0]),
    (0, padded_cols - n_cols),
  )
  padded = [jnp.pad(a[...] if written else a, pad(a)) for a in arrays]
  args, aliases = (*padded, *rows), {}
  if new is not None:
    out_type = jax.ShapeDtypeStruct(padded[0].shape, new)
    args = (*rows, *padded)
  elif written:
    out_type = jax.ShapeDtypeStruct(padded[-1].shape, padded[-1].dtype)
    args, aliases = (*rows, *padded), {len(rows) + len(padded) - 1: 0}
    body = lambda *refs, f=body: f(*refs[:-2], refs[-1])  # the aliased output
  gmem = plgpu.BlockSpec(memory_space=plgpu.GMEM)
  outputs = pl.pallas_call(
    body,
    out_shape=out_type,
    grid=(grid.row_blocks, grid.parts),
    in_specs=[gmem] * len(args),
    out_specs=jax.tree.map(lambda _: gmem, out_type),
    input_output_aliases=aliases,
    compiler_params=plgpu.CompilerParams(
      lowering_semantics=plgpu.LoweringSemantics.Warpgroup
    ),
    interpret=True,
    name=name,
  )(*args)
  if new is not None:
    return outputs[:n_rows, :n_cols]
  if written:
    arrays[-1][...] = outputs[: arrays[-1].shape[0], :n_cols]
    return None
  return [o[:, :n_rows] for o in outputs]


def _below(body, at: int, program: Program, block_rows: int, *refs) -> None:
  """``body(*refs)`` without ``refs[at]``, a ``[1]`` bound, in the programs
  of the row blocks that start before it."""
  *refs, bound_ref = (*refs[:at], *refs[at + 1 :], refs[at])

  @pl.when(program.index()[0] * block_rows < bound_ref[0])
  def _():
    body(*refs)


def takes(logits: jax.Array) -> bool:
  """Whether the Mosaic kernels take these logits (or an array of their
  shape and dtype): 16-bit or float32 floats, of whole TMA tiles."""
  dtype = jnp.dtype(logits.dtype)
  itemsize = dtype.itemsize
  n_rows, n_cols = logits.shape
  return (
    plgpu is not None
    and jnp.issubdtype(dtype, jnp.floating)
    and itemsize in (2, 4)
    and n_rows % _TILE_ROWS == 0
    and n_cols % (_TILE_BYTES // itemsize) == 0
  )
