"""The Mosaic GPU GEMM's kernels (Hopper, sm_90a); ``mst_jax._gemm.mosaic.gemm``
checks the arguments and picks the config.

``gemm`` launches one of two kernels for ``out[m, n] = A[m, k] @ B[k, n]``
(``Problem``), by ``GemmConfig.split``. Both:

1. Run a persistent grid, one block per SM, that walks the output tiles in a
   planar snake (neighbouring blocks share operand tiles in L2). With
   ``GemmConfig.k_splits`` > 1 it walks each tile's parts of the contraction
   too, writing float32 partial products that ``gemm`` sums (split-K: an
   output of few tiles over a long contraction, such as a small chunk's
   ``dhidden``, still keeps every SM busy).
2. Warp-specialize: one warpgroup issues TMA copies of the operands'
   ``[tile, tile_k]`` tiles into a ring of ``stages`` shared-memory slots;
   two compute warpgroups issue ``wgmma`` into float32 accumulators.
3. End each tile with an epilogue in the compute warpgroups
   (``_gemm.mosaic.epilogue``): the accumulator is rounded to the output
   dtype, or first added to the ``accumulate`` array's tile (loaded ahead,
   during the main loop), and stored through shared memory with TMA.

They differ in how the compute warpgroups share the work.
``_cooperative_kernel`` (``split="m"`` / ``"n"``): both work on each tile,
each on half of it, through Pallas's warp-specialized pipeline; during the
epilogue the tensor cores wait. ``_pingpong_kernel`` (``split="tiles"``):
each takes whole tiles in turn, so one's epilogue runs during the other's
main loop; the pipeline is written out here, since Pallas's feeds every
compute warpgroup the same steps. Only it runs a ``RowEpilogue`` (per-row
reductions of each tile, such as the cross-entropy's statistics of a tile
of logits), which its schedule hides behind the other warpgroup's ``wgmma``.

Sizes need not be multiples of the tiles: TMA fills reads past an array's end
with zeros (adding nothing to a dot product) and drops writes past it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from mst_jax._gemm.mosaic import epilogue as epilogues
from mst_jax._gemm.mosaic.config import (
  GemmConfig,
  Problem,
  epilogue_slots,
  narrow_error,
  ragged_error,
)

try:  # Mosaic GPU's Pallas front end; its lowering runs only on a Hopper GPU.
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError as e:  # pragma: no cover -- a jax without Mosaic GPU
  pl = plgpu = None
  IMPORT_ERROR: ImportError | None = e
else:
  IMPORT_ERROR = None

# Registers per thread: the memory warpgroup gives up what the two compute
# warpgroups take (an SM's 64K over 3 x 128 threads, in multiples of 8).
_MEMORY_REGISTERS = 40
_COMPUTE_REGISTERS = 232


def _operand_specs(problem: Problem, config: GemmConfig) -> list:
  """Block specs of the operand tiles one pipeline step copies.

  Each tile is copied as its operand is stored (``[tile_k, block]`` when the
  contraction runs along the rows); ``_operand_views`` hands wgmma a transposed
  view where the stored tile is not the ``[m, k]`` / ``[k, n]`` it expects.
  """
  tile_k, dtype = config.tile_k, problem.in_dtype

  def spec(block: int, k_major: bool):
    if k_major:  # stored [k, block]
      shape, index = (tile_k, block), lambda k: (k, 0)
    else:  # stored [block, k]
      shape, index = (block, tile_k), lambda k: (0, k)
    transforms = epilogues.smem_transforms(shape[1], dtype)
    return plgpu.BlockSpec(shape, index, transforms=transforms, memory_space=plgpu.SMEM)

  return [
    spec(config.block_m, k_major=problem.lhs_transposed),
    spec(config.block_n, k_major=not problem.rhs_transposed),
  ]


def _walk(problem: Problem, config: GemmConfig, bound=None):
  """The persistent grid's work: ``(count, split_steps, at)``: ``count``
  pieces of ``split_steps`` contraction steps each, where ``at(index)`` gives
  the ``index``-th piece's output rows, columns, contraction range and
  split-K part. Neighbouring blocks take the parts of one tile, then the next
  tile, along a planar snake (they share operand tiles in L2).

  With ``problem.bounded``, ``bound`` (a scalar read in the kernel) cuts the
  output's rows (``"m"``: the blocks of rows from ``bound`` on are left out)
  or the contraction (``"k"``: its ``tile_k`` steps from ``bound`` on), so
  ``count`` or ``split_steps`` are known on the device only."""
  p, c = problem, config
  steps = lambda k: pl.cdiv(pl.cdiv(k, c.tile_k), c.k_splits)  # tile_k steps
  m_rows, split_steps = p.m, steps(p.k)
  most_steps = split_steps  # static: the operands' views are this long
  if p.bounded == "m":
    m_rows = jnp.minimum(bound, p.m)
  elif p.bounded == "k":
    split_steps = steps(jnp.minimum(bound, p.k))
  grid = (pl.cdiv(m_rows, c.block_m), pl.cdiv(p.n, c.block_n))
  minor = 0 if c.grid_minor == "m" else 1

  def at(index):
    tile_index, part = index // c.k_splits, index % c.k_splits
    m_index, n_index = plgpu.planar_snake(tile_index, grid, minor, c.grid_tile_width)
    rows = pl.ds(m_index * c.block_m, c.block_m)
    cols = pl.ds(n_index * c.block_n, c.block_n)
    # The last part may run past K: TMA reads zeros there. Bounded, the
    # pipeline takes the view's first split_steps steps only.
    ks = pl.ds(part * split_steps * c.tile_k, most_steps * c.tile_k)
    return rows, cols, ks, part

  return grid[0] * grid[1] * c.k_splits, split_steps, at


def _operand_tiles(problem: Problem, a_gmem, b_gmem, rows, cols, ks):
  """The operands' ``rows`` / ``cols`` over contraction range ``ks``, as
  stored (``_operand_specs``' layouts)."""
  a = a_gmem.at[ks, rows] if problem.lhs_transposed else a_gmem.at[rows, ks]
  b = b_gmem.at[cols, ks] if problem.rhs_transposed else b_gmem.at[ks, cols]
  return a, b


def _operand_views(problem: Problem, a_smem, b_smem, wg_m, wg_n):
  """wgmma's ``[m, k]`` and ``[k, n]`` views of stored operand tiles."""
  if problem.lhs_transposed:  # [tile_k, block_m] as stored
    a = a_smem.at[:, wg_m].transpose((1, 0))
  else:
    a = a_smem.at[wg_m, :]
  if problem.rhs_transposed:  # [block_n, tile_k] as stored
    b = b_smem.at[wg_n, :].transpose((1, 0))
  else:
    b = b_smem.at[:, wg_n]
  return a, b


def _cooperative_kernel(
  a_gmem, b_gmem, out_gmem, *, problem: Problem, config: GemmConfig, bound=None
):
  """One block: a persistent walk over ``[block_m, block_n]`` output tiles
  (and with split-K, over the contraction's parts: ``out_gmem`` is then
  ``[k_splits, m, n]``, one partial product per part), both compute
  warpgroups on each tile (``split="m"`` or ``"n"``)."""
  p, c = problem, config
  count, split_steps, at = _walk(p, c, bound)

  def pipeline(body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
      body,
      grid=(split_steps,),
      memory_registers=_MEMORY_REGISTERS,
      in_specs=_operand_specs(p, c),
      wg_axis="wg",
      num_compute_wgs=2,
      max_concurrent_steps=c.stages,
      compute_context=compute_context,
    )

  slots = epilogue_slots(c)
  ignore = lambda *_, **__: None  # the allocations do not depend on the bodies

  @functools.partial(
    pl.run_scoped,
    allocations=pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem),
    out_smem=epilogues.out_smem(c, p.out_dtype),
    load_barrier=plgpu.Barrier(num_barriers=2 * slots) if p.accumulate else None,
    collective_axes="wg",
  )
  def _scope(allocations, out_smem, load_barrier):
    wg = lax.axis_index("wg")
    wg_m = pl.ds(wg * c.tile_m, c.tile_m) if c.split == "m" else slice(None)
    wg_n = pl.ds(wg * c.tile_n, c.tile_n) if c.split == "n" else slice(None)

    @plgpu.nd_loop((count,), collective_axes="sm")
    def _tile(loop_info):
      rows, cols, ks, part = at(loop_info.index[0])
      out = out_gmem.at[part] if c.k_splits > 1 else out_gmem

      def mma(_, a_smem, b_smem, acc_ref):
        plgpu.wgmma(acc_ref, *_operand_views(p, a_smem, b_smem, wg_m, wg_n))
        plgpu.wgmma_wait(0)
        return acc_ref

      def compute_context(run_pipeline):
        out_tile = out.at[rows, cols].at[wg_m, wg_n]
        staging = out_smem.at[wg]
        store = epilogues.TileStore(out_tile, staging, load_barrier, wg, p, c, staging)
        store.begin()

        @functools.partial(
          pl.run_scoped, acc_ref=plgpu.ACC((c.tile_m, c.tile_n), jnp.float32)
        )
        def _accumulator(acc_ref):
          run_pipeline(acc_ref)
          store.store(acc_ref[...])

      pipeline(mma, compute_context)(
        *_operand_tiles(p, a_gmem, b_gmem, rows, cols, ks), allocations=allocations
      )

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last stores' reads


def _pingpong_kernel(
  a_gmem,
  b_gmem,
  *refs,
  problem: Problem,
  config: GemmConfig,
  num_sms: int,
  rows_epilogue: epilogues.RowEpilogue | None = None,
  bound=None,
):
  """One block (``split="tiles"``): the memory warpgroup copies the operand
  tiles of all the block's output tiles, in order, through one ring of
  ``stages`` slots; compute warpgroup ``w`` takes the block's tiles ``w, w +
  2, ...``. The ring orders them: a warpgroup's main loop starts as the
  other's ends, and its epilogue runs during the other's main loop.

  ``refs``: the output (a Ref when accumulating), or with ``rows_epilogue``
  its ``[m]`` row inputs, the output and its ``[n / tile_n, m]`` row outputs.
  """
  p, c = problem, config
  row_inputs, row_outputs = [], []
  if rows_epilogue is None:
    (out_gmem,) = refs
  else:
    inputs = len(rows_epilogue.input_dtypes)
    row_inputs, (out_gmem, *row_outputs) = refs[:inputs], refs[inputs:]
  count, split_steps, at = _walk(p, c, bound)
  sm = lax.axis_index("sm")
  tiles = (count - sm + num_sms - 1) // num_sms  # this block's: sm + i num_sms
  a_smem, b_smem = (  # rings of the pipeline's operand tiles
    epilogues.smem((c.stages, *spec.block_shape), p.in_dtype, ragged)
    for spec, ragged in zip(_operand_specs(p, c), p.ragged, strict=False)
  )
  slots = epilogue_slots(c)

  @functools.partial(
    pl.run_scoped,
    a_smem=a_smem,
    b_smem=b_smem,
    # [w * stages + slot]: the slot holds a step of warpgroup w's tile. A
    # barrier's phases are tracked per thread, so each warpgroup waits only
    # on its own (the memory warpgroup on every "consumed" one).
    loaded=plgpu.Barrier(num_arrivals=2, num_barriers=2 * c.stages),
    consumed=plgpu.Barrier(num_arrivals=1, num_barriers=c.stages),
    out_smem=epilogues.out_smem(c, p.out_dtype, p.ragged[2]),
    load_barrier=plgpu.Barrier(num_barriers=2 * slots) if p.accumulate else None,
    row_scratch=epilogues.row_scratch(rows_epilogue, c),
    collective_axes="wg",
  )
  def _scope(a_smem, b_smem, loaded, consumed, out_smem, load_barrier, row_scratch):
    wg = lax.axis_index("wg")
    # (compute view, copy view) of each buffer: two views of one where TMA
    # copies its array a row at a time (Problem.ragged).
    (a_smem, a_copy), (b_smem, b_copy), (out_smem, out_copy) = (
      epilogues.views(buffer, ragged)
      for buffer, ragged in zip((a_smem, b_smem, out_smem), p.ragged, strict=True)
    )

    def memory():
      plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")

      @pl.loop(0, tiles)
      def _tile(local):
        rows, cols, ks, _ = at(sm + local * num_sms)
        owner = local % 2

        @pl.loop(0, split_steps)
        def _step(step):
          index = local * split_steps + step
          slot = index % c.stages
          barrier = loaded.at[owner * c.stages + slot]

          @pl.when(index >= c.stages)
          def _():
            plgpu.barrier_wait(consumed.at[slot])

          k = pl.ds(ks.start + step * c.tile_k, c.tile_k)
          a_tile, b_tile = _operand_tiles(p, a_gmem, b_gmem, rows, cols, k)
          plgpu.copy_gmem_to_smem(a_tile, a_copy.at[slot], barrier)
          plgpu.copy_gmem_to_smem(b_tile, b_copy.at[slot], barrier)

    def compute():
      plgpu.set_max_registers(_COMPUTE_REGISTERS, action="increase")

      @pl.loop(wg, tiles, step=2)
      def _tile(local):
        rows, cols, _, part = at(sm + local * num_sms)
        out = out_gmem.at[part] if c.k_splits > 1 else out_gmem
        store = epilogues.TileStore(
          out.at[rows, cols], out_smem.at[wg], load_barrier, wg, p, c, out_copy.at[wg]
        )
        store.begin()
        if rows_epilogue is not None:
          row_outs = epilogues.RowOutputs(
            rows_epilogue, row_inputs, row_outputs, row_scratch, wg, c
          )
          row_outs.begin(rows)

        @functools.partial(
          pl.run_scoped, acc_ref=plgpu.ACC((c.tile_m, c.tile_n), jnp.float32)
        )
        def _accumulator(acc_ref):
          first = local * split_steps

          @pl.loop(0, split_steps)
          def _step(step):
            slot = (first + step) % c.stages
            plgpu.barrier_wait(loaded.at[wg * c.stages + slot])
            whole = slice(None)
            a, b = _operand_views(p, a_smem.at[slot], b_smem.at[slot], whole, whole)
            plgpu.wgmma(acc_ref, a, b)
            plgpu.wgmma_wait(1)  # the step before's wgmma is done: free its slot

            @pl.when(step > 0)
            def _():
              plgpu.barrier_arrive(consumed.at[(first + step - 1) % c.stages])

          plgpu.wgmma_wait(0)
          plgpu.barrier_arrive(consumed.at[(first + split_steps - 1) % c.stages])
          if rows_epilogue is None:
            store.store(acc_ref[...])
          else:  # rounded once: the reductions see the tile as stored
            tile = acc_ref[...].astype(p.out_dtype)
            store.store(tile)
            row_outs.finish(tile, rows, cols)

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last stores' reads

    lax.cond(wg == 2, memory, compute)


def gemm(
  lhs,
  rhs,
  accumulate,
  problem: Problem,
  config: GemmConfig,
  num_sms: int,
  rows: tuple[epilogues.RowEpilogue, list] | None = None,
  bound: jax.Array | None = None,
):
  """Launches the kernel; ``accumulate`` (or None) is updated through a Ref.

  Split along K, the blocks write float32 partial products, summed here.
  With ``rows=(epilogue, inputs)`` (ping-pong only), returns the output and
  the epilogue's ``[n / tile_n, m]`` row outputs. ``bound``: the scalar
  that cuts a ``problem.bounded`` product (``_walk``), passed to the kernel
  as a ``[1]`` int32 array.
  """
  if config.k_splits > 1 and accumulate is not None:
    raise ValueError("split-K (k_splits > 1) does not accumulate")
  if rows is not None and (
    config.split != "tiles" or config.k_splits > 1 or accumulate is not None
  ):
    raise ValueError("a RowEpilogue runs in unsplit ping-pong products only")
  error = ragged_error(config, problem) or narrow_error(config, problem)
  if error is not None:
    raise ValueError(f"{config} does not fit the problem: {error}")
  kernel_problem = problem
  if config.k_splits > 1:
    kernel_problem = dataclasses.replace(problem, out_dtype=jnp.dtype(jnp.float32))
  mesh = plgpu.Mesh(
    grid=(num_sms,), grid_names=("sm",), num_threads=3, thread_name="wg"
  )
  epilogue, inputs = rows or (None, [])
  if config.split == "tiles":
    body = functools.partial(_pingpong_kernel, num_sms=num_sms, rows_epilogue=epilogue)
  else:
    body = _cooperative_kernel
  # Named by shape, so that a profile tells a step's products apart.
  name = f"mst_jax_mosaic_gemm_{problem.m}x{problem.n}x{problem.k}"
  body = functools.partial(body, problem=kernel_problem, config=config)
  bound_args = ()
  if problem.bounded is not None:
    bound_args = (jnp.asarray(bound, jnp.int32).reshape(1),)
    body = functools.partial(_read_bound, body)
  kernel = functools.partial(
    pl.kernel,
    body,
    mesh=mesh,
    compiler_params=plgpu.CompilerParams(
      approx_math=epilogue is not None and epilogue.approx_math,
      lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
    ),
    name=name
    + (f"_bounded_{problem.bounded}" if problem.bounded is not None else "")
    + ("_add" if accumulate is not None else "")
    + ("_rows" if epilogue is not None else ""),
  )
  operands = (*bound_args, lhs, rhs)
  if config.k_splits > 1:
    shape = (config.k_splits, problem.m, problem.n)
    parts = kernel(out_type=jax.ShapeDtypeStruct(shape, jnp.float32))(*operands)
    return jnp.sum(parts, axis=0).astype(problem.out_dtype)
  out_type = jax.ShapeDtypeStruct((problem.m, problem.n), problem.out_dtype)
  if epilogue is not None:
    row_types = epilogues.row_out_types(epilogue, problem, config)
    padded = [epilogues.pad_rows(x, config) for x in inputs]
    out, *row_outputs = kernel(out_type=[out_type, *row_types])(*operands, *padded)
    return out, [x[:, : problem.m] for x in row_outputs]
  if accumulate is None:
    return kernel(out_type=out_type)(*operands)
  out_ref = jax.new_ref(accumulate)
  kernel(out_type=())(*operands, out_ref)
  return jax.freeze(out_ref)


def _read_bound(body, bound_ref, *refs):
  """``body(*refs, bound=)`` with the bound read from its ``[1]`` array."""
  return body(*refs, bound=bound_ref[0])
