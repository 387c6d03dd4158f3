"""Per-chunk cross-entropy as Pallas kernels lowered through Mosaic GPU (Hopper).

Two kernels over a chunk's 16-bit logits ``[R, V]`` (all math in float32 and
``ce_math``'s, as in the other backends):

1. ``_stats_kernel``: the ``RowStats`` of a ``[block_rows, V / parts]`` slab,
   in one online pass over ``[block_rows, block_v]`` tiles that TMA streams
   into shared memory ahead of the math (``stages`` deep). The vocabulary is
   cut into ``parts`` so that a chunk of few rows still gives every SM work;
   ``ce_math.combine_stats`` merges the parts' statistics.
2. ``_dlogits_kernel``: elementwise ``dlogits`` (``ce_math.dlogits_block``)
   over the same tiles, written over the logits when the dtypes match.

TMA moves whole shared-memory tiles of 8 rows x 128 bytes, so the kernels take
logits of ``8 i`` rows and ``64 j`` columns (V = 32000, 128256 or 256000, not
50257); rows and columns past the array's ends are read as zeros and not
written. What they do not take (other shapes, float32 logits, a group buffer
to write into, the fused sweep's ``into``) goes to the Triton kernels:
``MosaicChunkCE`` extends ``PallasTritonChunkCE``.

On a CPU the kernels run in interpret mode: each program reads its tiles
straight from arrays padded to whole tiles, without TMA or swizzling.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from mst_jax import _ce_math as ce_math
from mst_jax._backends import base
from mst_jax._backends.pallas_triton import PallasTritonChunkCE

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
      times parts reaches this (about two per SM).
  """

  block_rows: int = 64
  block_v: int = 256
  stages: int = 3
  programs: int = 264

  def __post_init__(self) -> None:
    for name, multiple in (("block_rows", 64), ("block_v", 64)):
      value = getattr(self, name)
      if not (isinstance(value, int) and value > 0 and value % multiple == 0):
        raise ValueError(f"MosaicBlocks.{name} must be a multiple of {multiple}.")
    for name in ("stages", "programs"):
      if not (isinstance(value := getattr(self, name), int) and value >= 1):
        raise ValueError(f"MosaicBlocks.{name} must be >= 1, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class _Grid:
  """Row blocks x vocabulary parts x tiles per part."""

  row_blocks: int
  parts: int
  steps: int

  @classmethod
  def of(cls, n_rows: int, n_cols: int, blocks: MosaicBlocks) -> _Grid:
    row_blocks = pl.cdiv(n_rows, blocks.block_rows)
    tiles = pl.cdiv(n_cols, blocks.block_v)
    parts = min(tiles, max(1, pl.cdiv(blocks.programs, row_blocks)))
    steps = pl.cdiv(tiles, parts)
    return cls(row_blocks, pl.cdiv(tiles, steps), steps)

  def widths(self, n_cols: int, block_v: int) -> jax.Array:
    """Each part's number of columns, float32 ``[parts, 1]``."""
    starts = jnp.arange(self.parts) * self.steps * block_v
    return jnp.minimum(n_cols - starts, self.steps * block_v)[:, None].astype(
      jnp.float32
    )


def _per_row(x, shape):
  return lax.broadcast_in_dim(x, shape, (0,))


def _transforms(block_v: int, dtype, interpret: bool) -> tuple:
  """Shared-memory tiling and swizzle of a ``[rows, block_v]`` tile (none in
  interpret mode, which reads arrays as they are)."""
  if interpret:
    return ()
  bits = jnp.dtype(dtype).itemsize * 8
  swizzle = plgpu.find_swizzle(block_v * bits)
  tiling = plgpu.TilingTransform((_TILE_ROWS, swizzle * 8 // bits))
  return tiling, plgpu.SwizzleTransform(swizzle)


def _walk(body, tile_index, grid, blocks, interpret, ins, outs=(), *, init=None):
  """Runs ``body(index, *in_tiles, *out_tiles[, carry])`` over a program's
  ``grid.steps`` tiles of the ``[R, V]`` arrays ``ins`` and ``outs`` (in
  device memory): a TMA pipeline ``blocks.stages`` deep, or in interpret mode
  a loop over the tiles of arrays padded to whole parts. Returns the carry."""
  shape = (blocks.block_rows, blocks.block_v)
  if interpret:

    def step(index, carry):
      rows, cols = tile_index(index)
      window = (pl.ds(rows * shape[0], shape[0]), pl.ds(cols * shape[1], shape[1]))
      tiles = [ref.at[window] for ref in (*ins, *outs)]
      if init is None:
        body((index,), *tiles)
        return carry
      return body((index,), *tiles, carry)

    return lax.fori_loop(0, grid.steps, step, init)
  spec = functools.partial(
    plgpu.BlockSpec,
    shape,
    tile_index,
    transforms=_transforms(shape[1], ins[0].dtype, interpret),
  )
  return plgpu.emit_pipeline(
    body,
    grid=(grid.steps,),
    in_specs=[spec() for _ in ins],
    out_specs=[spec() for _ in outs],
    max_concurrent_steps=blocks.stages,
    init_carry=init,
  )(*ins, *outs)


def _stats_kernel(
  logits_gmem,  # [R, V] 16-bit, in device memory
  labels_ref,  # [block_rows] int32
  *out_refs,  # [block_rows] each: max, log-sum-exp, target, argmax, [total], [E]
  options: ce_math.CEOptions,
  blocks: MosaicBlocks,
  grid: _Grid,
  n_cols: int,
  interpret: bool,
):
  row_block, part = pl.program_id(0), pl.program_id(1)
  shape = (blocks.block_rows, blocks.block_v)
  labels = labels_ref[...]

  def body(index, tile_ref, carry):
    row_max, sum_exp, target, total, weighted, argmax = carry
    first_col = (part * grid.steps + index[0]) * blocks.block_v
    cols = first_col + lax.broadcasted_iota(jnp.int32, shape, 1)
    capped = ce_math.scores(tile_ref[...].astype(jnp.float32), options)
    live = jnp.where(cols < n_cols, capped, -jnp.inf)
    block_max = live.max(axis=1)
    new_max = jnp.maximum(row_max, block_max)
    shift = ce_math.max_shift(new_max)  # 0 while every score is -inf
    rescale = jnp.exp(row_max - shift)
    unnormalized = jnp.exp(live - _per_row(shift, shape))
    sum_exp = sum_exp * rescale + unnormalized.sum(axis=1)
    target = target + jnp.where(cols == _per_row(labels, shape), live, 0.0).sum(axis=1)
    if options.label_smoothing:
      total = total + jnp.where(cols < n_cols, capped, 0.0).sum(axis=1)
    if options.entropy:  # sum_j exp(s_j - shift) s_j; a -inf score adds 0
      spread = jnp.where(unnormalized > 0, unnormalized * live, 0.0)
      weighted = weighted * rescale + spread.sum(axis=1)
    # The first column of the block's max, kept if it beats the earlier blocks.
    first = jnp.where(live == _per_row(block_max, shape), cols, n_cols).min(axis=1)
    argmax = jnp.where(block_max > row_max, first, argmax)
    return new_max, sum_exp, target, total, weighted, argmax

  zeros = jnp.zeros((blocks.block_rows,), jnp.float32)
  lowest = jnp.full((blocks.block_rows,), -jnp.inf, jnp.float32)
  init = (lowest, zeros, zeros, zeros, zeros, jnp.zeros_like(labels))
  tile_index = lambda step: (row_block, part * grid.steps + step)
  carry = _walk(body, tile_index, grid, blocks, interpret, [logits_gmem], init=init)
  row_max, sum_exp, target, total, weighted, argmax = carry
  values = [row_max, jnp.log(sum_exp), target, argmax]
  if options.label_smoothing:
    values.append(total)
  if options.entropy:
    values.append(weighted / sum_exp)
  for ref, value in zip(out_refs, values, strict=True):
    ref[...] = value


def _dlogits_kernel(
  logits_gmem,  # [R, V] 16-bit, in device memory
  labels_ref,  # [block_rows] int32
  *refs,  # [block_rows] float32 each: BackwardRows' fields; then dlogits [R, V]
  options: ce_math.CEOptions,
  blocks: MosaicBlocks,
  grid: _Grid,
  n_cols: int,
  vocab_total: int,
  interpret: bool,
):
  del n_cols  # TMA drops the columns past V (interpret mode slices them off)
  *row_refs, out_gmem = refs
  row_block, part = pl.program_id(0), pl.program_id(1)
  shape = (blocks.block_rows, blocks.block_v)
  labels = labels_ref[...]
  values = [ref[...] for ref in row_refs]
  rows = ce_math.BackwardRows(*values[:3])
  if options.entropy:
    rows = rows._replace(coef_entropy=values[3], expected_score=values[4])

  def body(index, tile_ref, out_ref):
    first_col = (part * grid.steps + index[0]) * blocks.block_v
    cols = first_col + lax.broadcasted_iota(jnp.int32, shape, 1)
    logits = tile_ref[...].astype(jnp.float32)
    grad = ce_math.dlogits_block(logits, cols, labels, rows, options, vocab_total)
    out_ref[...] = grad.astype(out_ref.dtype)

  tile_index = lambda step: (row_block, part * grid.steps + step)
  _walk(body, tile_index, grid, blocks, interpret, [logits_gmem], [out_gmem])


def takes(logits: jax.Array) -> bool:
  """Whether the Mosaic kernels take these logits: 16-bit, of whole TMA tiles."""
  itemsize = jnp.dtype(logits.dtype).itemsize
  n_rows, n_cols = logits.shape
  return (
    plgpu is not None
    and itemsize == 2
    and n_rows % _TILE_ROWS == 0
    and n_cols % (_TILE_BYTES // itemsize) == 0
  )


@dataclasses.dataclass(frozen=True)
class MosaicChunkCE(PallasTritonChunkCE):
  """The logits GEMM, then the cross-entropy as Pallas kernels lowered
  through Mosaic GPU where they take the logits (``takes``), else through
  Triton (``blocks`` and ``interpret``: ``TritonKernels``).

  Attributes:
    tiles: the Mosaic kernels' tiles.
  """

  tiles: MosaicBlocks = MosaicBlocks()

  def _run(self, kernel, name, logits, row_values, out_shape, *, aliases=None):
    """``kernel`` over a ``(row blocks, parts)`` grid, with ``logits`` in
    device memory and each ``[R]`` row value in blocks of the program's rows.
    ``out_shape``: ``[parts, R]`` rows per part, or with ``aliases`` (the
    ``input_output_aliases``) one ``[R, V]`` array in device memory."""
    n_rows, n_cols = logits.shape
    t = self.tiles
    grid = _Grid.of(n_rows, n_cols, t)
    gmem = plgpu.BlockSpec(memory_space=plgpu.GMEM)
    row_spec = plgpu.BlockSpec((t.block_rows,), lambda i, p: (i,))
    part_spec = plgpu.BlockSpec((None, t.block_rows), lambda i, p: (p, i))
    out_specs = [part_spec] * len(out_shape) if aliases is None else [gmem]
    if self.interpret:  # whole parts of whole tiles, zeros past the ends
      padded = (grid.row_blocks * t.block_rows, grid.parts * grid.steps * t.block_v)
      pads = [(0, padded[0] - n_rows), (0, padded[1] - n_cols)]
      logits = jnp.pad(logits, pads)
      if aliases is not None:
        out_shape = [jax.ShapeDtypeStruct(padded, out_shape[0].dtype)]
    call = pl.pallas_call(
      functools.partial(
        kernel, grid=grid, blocks=t, n_cols=n_cols, interpret=self.interpret
      ),
      out_shape=tuple(out_shape),
      grid=(grid.row_blocks, grid.parts),
      in_specs=[gmem, *[row_spec] * len(row_values)],
      out_specs=out_specs,
      compiler_params=plgpu.CompilerParams(
        lowering_semantics=plgpu.LoweringSemantics.Warpgroup
      ),
      input_output_aliases=aliases or {},
      interpret=self.interpret,
      name=name,
    )
    outputs = call(logits, *row_values)
    if self.interpret and aliases is not None:
      outputs = [outputs[0][:n_rows, :n_cols]]
    return grid, outputs

  def forward(self, logits, labels, options):
    if not takes(logits):
      return super().forward(logits, labels, options)
    n_rows, n_cols = logits.shape
    grid = _Grid.of(n_rows, n_cols, self.tiles)
    part_rows = jax.ShapeDtypeStruct((grid.parts, n_rows), jnp.float32)
    part_index = jax.ShapeDtypeStruct((grid.parts, n_rows), jnp.int32)
    extra = bool(options.label_smoothing) + options.entropy
    out_shape = [part_rows, part_rows, part_rows, part_index] + [part_rows] * extra
    kernel = functools.partial(_stats_kernel, options=options)
    grid, outputs = self._run(
      kernel, "mst_ce_stats_mosaic", logits, [labels], out_shape
    )
    row_max, log_sum_exp, target, argmax, *rest = outputs
    widths = grid.widths(n_cols, self.tiles.block_v)
    total = rest.pop(0) if options.label_smoothing else jnp.zeros_like(target)
    parts = ce_math.RowStats(
      row_max,
      log_sum_exp,
      target,
      total / widths,
      argmax,
      expected_score=rest.pop(0) if options.entropy else None,
    )
    # Each part's target is 0 unless it holds the label; argmax is global.
    return ce_math.combine_stats(
      parts,
      jnp.ones(target.shape, bool),
      0,
      widths,
      n_cols,
      reduce_max=functools.partial(jnp.max, axis=0),
      reduce_sum=functools.partial(jnp.sum, axis=0),
      reduce_min=functools.partial(jnp.min, axis=0),
    )

  def backward(self, logits, labels, rows, options, out_dtype, vocab_size=None):
    out_dtype = jnp.dtype(out_dtype)
    if not takes(logits) or out_dtype.itemsize != 2:
      return super().backward(logits, labels, rows, options, out_dtype, vocab_size)
    n_cols = logits.shape[1]
    row_values = [labels, rows.lse, rows.coef_softmax, rows.coef_target]
    if options.entropy:
      row_values += [rows.coef_entropy, rows.expected_score]
    kernel = functools.partial(
      _dlogits_kernel, options=options, vocab_total=vocab_size or n_cols
    )
    # dlogits overwrite logits of their own dtype: each tile is read before
    # it is written, and the logits have no other reader.
    in_place = logits.dtype == out_dtype
    _, (dlogits,) = self._run(
      kernel,
      "mst_ce_dlogits_mosaic",
      logits,
      row_values,
      [jax.ShapeDtypeStruct(logits.shape, out_dtype)],
      aliases={0: 0} if in_place else {},
    )
    return dlogits

  def forward_backward(
    self, logits, labels, valid, g_loss, options, out_dtype, *, into=None
  ):
    if into is not None or not takes(logits):
      return super().forward_backward(
        logits, labels, valid, g_loss, options, out_dtype, into=into
      )
    return base.unfused_forward_backward(
      self, logits, labels, valid, g_loss, options, out_dtype, into=None
    )
