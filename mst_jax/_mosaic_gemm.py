"""The LM head's GEMMs as one Mosaic GPU kernel for Hopper (sm_90a).

``matmul`` computes ``lax.dot_general(lhs, rhs, dimension_numbers,
preferred_element_type=out_dtype)`` for 2-D operands contracted over one
dimension each, which covers the head's three products in both weight layouts
(``mst_jax._matmul``): an operand contracted over its rows is read as
transposed shared-memory tiles (wgmma's transpose bits), so the weight is
never transposed or copied in device memory.

The kernel, read top to bottom:

1. A persistent grid, one block per SM, walks the output tiles in a planar
   snake (neighbouring blocks share operand tiles in L2). With
   ``GemmConfig.k_splits`` > 1 it walks each tile's parts of the contraction
   too, writing float32 partial products that ``_gemm`` sums (split-K: an
   output of few tiles over a long contraction, such as a small chunk's
   ``dhidden``, still keeps every SM busy).
2. Per output tile, a warp-specialized pipeline: one warpgroup issues TMA
   copies of the operands' ``[tile, tile_k]`` tiles into a ring of
   ``stages`` shared-memory slots; two compute warpgroups each own half the
   output tile and issue ``wgmma`` into a float32 accumulator.
3. The epilogue (in the compute warpgroups) rounds the accumulator to the
   output dtype, or first adds the ``accumulate`` array's tile (loaded ahead,
   during the main loop), and stores through shared memory with TMA.

Sizes need not be multiples of the tiles: TMA fills reads past an array's end
with zeros (adding nothing to a dot product) and drops writes past it. Mosaic
GPU does describe each array to TMA as whole shared-memory tiles of 8 rows x
128 bytes, so every operand and the output must have a multiple of 8 rows
and of 64 (16-bit) or 32 (float32) columns as stored: V = 32000, 128256 or
256000 qualify, GPT-2's 50257 does not. ``matmul`` raises
``NotImplementedError`` for other shapes.

The module imports on any jax (a missing Mosaic GPU is reported when
``matmul`` is called); without a Hopper GPU ``matmul`` raises
``NotImplementedError``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from mst_jax._mosaic_gemm_config import (
  GemmConfig,
  default_config,
  epilogue_slots,
)

try:  # Mosaic GPU's Pallas front end; its lowering runs only on a Hopper GPU.
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError as e:  # pragma: no cover -- a jax without Mosaic GPU
  pl = plgpu = None
  _IMPORT_ERROR: ImportError | None = e
else:
  _IMPORT_ERROR = None

_INPUT_DTYPES = ("bfloat16", "float16")
_OUTPUT_DTYPES = ("bfloat16", "float16", "float32")
_SWIZZLE_BYTES = 128  # shared-memory tiles are 8 rows of 128 swizzled bytes


@dataclasses.dataclass(frozen=True)
class _Problem:
  """The static shape of one call: ``out[m, n] = A[m, k] @ B[k, n]``."""

  m: int
  n: int
  k: int
  lhs_transposed: bool  # lhs is stored [k, m]
  rhs_transposed: bool  # rhs is stored [n, k]
  in_dtype: jnp.dtype
  out_dtype: jnp.dtype
  accumulate: bool


def _check(lhs, rhs, dimension_numbers, out_dtype, accumulate) -> _Problem:
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
  if lhs.shape[lc] != rhs.shape[rc]:
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
  m, n, k = lhs.shape[1 - lc], rhs.shape[1 - rc], lhs.shape[lc]
  if accumulate is not None:
    if accumulate.shape != (m, n):
      raise ValueError(
        f"accumulate has shape {accumulate.shape}, the product ({m}, {n})"
      )
    if accumulate.dtype != out_dtype:
      raise TypeError(f"accumulate is {accumulate.dtype}, out_dtype {out_dtype}")
  for name, shape, dtype in (
    ("lhs", lhs.shape, lhs.dtype),
    ("rhs", rhs.shape, rhs.dtype),
    ("output", (m, n), out_dtype),
  ):
    row_elements = _SWIZZLE_BYTES // jnp.dtype(dtype).itemsize
    if shape[0] % 8 or shape[1] % row_elements:
      raise NotImplementedError(
        f"mosaic_gemm.matmul: the {name} {shape} ({jnp.dtype(dtype).name}) is not"
        f" [8 i, {row_elements} j]: TMA copies it as whole 8 x {_SWIZZLE_BYTES}-byte"
        " tiles; use lax.dot_general."
      )
  in_dtype, has_accumulate = jnp.dtype(lhs.dtype), accumulate is not None
  return _Problem(m, n, k, lc == 0, rc == 1, in_dtype, out_dtype, has_accumulate)


def _smem_transforms(minor_elements: int, dtype) -> tuple:
  """Tiling and swizzle of a shared-memory tile ``minor_elements`` wide."""
  bits = jnp.dtype(dtype).itemsize * 8
  swizzle = plgpu.find_swizzle(minor_elements * bits)
  tiling = plgpu.TilingTransform((8, swizzle * 8 // bits))
  return tiling, plgpu.SwizzleTransform(swizzle)


def _operand_specs(problem: _Problem, config: GemmConfig) -> list:
  """Block specs of the operand tiles one pipeline step copies.

  Each tile is copied as its operand is stored (``[tile_k, block]`` when the
  contraction runs along the rows); ``_gemm_kernel`` hands wgmma a transposed
  view where the stored tile is not the ``[m, k]`` / ``[k, n]`` it expects.
  """
  tile_k, dtype = config.tile_k, problem.in_dtype

  def spec(block: int, k_major: bool):
    if k_major:  # stored [k, block]
      shape, index = (tile_k, block), lambda k: (k, 0)
    else:  # stored [block, k]
      shape, index = (block, tile_k), lambda k: (0, k)
    transforms = _smem_transforms(shape[1], dtype)
    return plgpu.BlockSpec(shape, index, transforms=transforms, memory_space=plgpu.SMEM)

  return [
    spec(config.block_m, k_major=problem.lhs_transposed),
    spec(config.block_n, k_major=not problem.rhs_transposed),
  ]


def _gemm_kernel(a_gmem, b_gmem, out_gmem, *, problem: _Problem, config: GemmConfig):
  """One block: a persistent walk over ``[block_m, block_n]`` output tiles
  (and with split-K, over the contraction's parts: ``out_gmem`` is then
  ``[k_splits, m, n]``, one partial product per part)."""
  p, c = problem, config
  m_iters, n_iters = pl.cdiv(p.m, c.block_m), pl.cdiv(p.n, c.block_n)
  split_steps = pl.cdiv(pl.cdiv(p.k, c.tile_k), c.k_splits)  # tile_k steps

  def pipeline(body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
      body,
      grid=(split_steps,),
      memory_registers=40,
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
    out_smem=plgpu.SMEM(
      (2, slots, c.epilogue_m, c.epilogue_n),
      p.out_dtype,
      transforms=_smem_transforms(c.epilogue_n, p.out_dtype),
    ),
    load_barrier=plgpu.Barrier(num_barriers=2 * slots) if p.accumulate else None,
    collective_axes="wg",
  )
  def _scope(allocations, out_smem, load_barrier):
    wg = lax.axis_index("wg")
    wg_m = pl.ds(wg * c.tile_m, c.tile_m) if c.split == "m" else slice(None)
    wg_n = pl.ds(wg * c.tile_n, c.tile_n) if c.split == "n" else slice(None)

    @plgpu.nd_loop((m_iters * n_iters * c.k_splits,), collective_axes="sm")
    def _tile(loop_info):
      (index,) = loop_info.index
      # Neighbouring blocks take the parts of one tile, then the next tile.
      tile_index, part = index // c.k_splits, index % c.k_splits
      minor = 0 if c.grid_minor == "m" else 1
      grid = (m_iters, n_iters)
      m_index, n_index = plgpu.planar_snake(tile_index, grid, minor, c.grid_tile_width)
      rows = pl.ds(m_index * c.block_m, c.block_m)
      cols = pl.ds(n_index * c.block_n, c.block_n)
      # The last part may run past K: TMA reads zeros there.
      ks = pl.ds(part * split_steps * c.tile_k, split_steps * c.tile_k)
      out = out_gmem.at[part] if c.k_splits > 1 else out_gmem

      def mma(_, a_smem, b_smem, acc_ref):
        if p.lhs_transposed:  # [tile_k, block_m] as stored
          a = a_smem.at[:, wg_m].transpose((1, 0))
        else:
          a = a_smem.at[wg_m, :]
        if p.rhs_transposed:  # [block_n, tile_k] as stored
          b = b_smem.at[wg_n, :].transpose((1, 0))
        else:
          b = b_smem.at[:, wg_n]
        plgpu.wgmma(acc_ref, a, b)
        plgpu.wgmma_wait(0)
        return acc_ref

      def compute_context(run_pipeline):
        out_tile = out.at[rows, cols].at[wg_m, wg_n]
        store = _TileStore(out_tile, out_smem.at[wg], load_barrier, wg, p, c)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's stores
        if p.accumulate:  # the first pieces of the addend arrive during the loop
          for index in range(min(slots, len(_pieces(c)))):
            store.load_addend(index)

        @functools.partial(
          pl.run_scoped, acc_ref=plgpu.ACC((c.tile_m, c.tile_n), jnp.float32)
        )
        def _accumulator(acc_ref):
          run_pipeline(acc_ref)
          store.store(acc_ref[...])

      pipeline(mma, compute_context)(
        a_gmem.at[ks, rows] if p.lhs_transposed else a_gmem.at[rows, ks],
        b_gmem.at[cols, ks] if p.rhs_transposed else b_gmem.at[ks, cols],
        allocations=allocations,
      )

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last stores' reads


def _pieces(c: GemmConfig) -> list[tuple[slice, slice]]:
  """A warpgroup tile's ``[epilogue_m, epilogue_n]`` pieces, in store order."""
  em, en = c.epilogue_m, c.epilogue_n
  return [
    (slice(i * em, (i + 1) * em), slice(j * en, (j + 1) * en))
    for i in range(c.tile_m // em)
    for j in range(c.tile_n // en)
  ]


@dataclasses.dataclass(frozen=True)
class _TileStore:
  """The epilogue of one warpgroup's ``[tile_m, tile_n]`` output tile.

  Pieces go through the warpgroup's shared-memory slots by TMA (rows and
  columns past the array's end are read as zeros and not written). With
  ``accumulate``, each piece's addend is loaded into its slot ahead of time:
  the first ``slots`` during the main loop, each later one as soon as the
  store before it in its slot has read the slot.
  """

  out_tile: object  # GMEM [tile_m, tile_n] view
  out_smem: object  # SMEM [slots, epilogue_m, epilogue_n]
  load_barrier: object  # [2 * slots] barriers, or None
  wg: jax.Array
  p: _Problem
  c: GemmConfig

  def _slot(self, index: int) -> tuple[int, object]:
    slot = index % epilogue_slots(self.c)
    return slot, self.load_barrier.at[self.wg * epilogue_slots(self.c) + slot]

  def load_addend(self, index: int) -> None:
    rows, cols = _pieces(self.c)[index]
    slot, barrier = self._slot(index)
    plgpu.copy_gmem_to_smem(
      self.out_tile.at[rows, cols], self.out_smem.at[slot], barrier
    )

  def store(self, acc: jax.Array) -> None:
    pieces, slots = _pieces(self.c), epilogue_slots(self.c)
    for index, (rows, cols) in enumerate(pieces):
      slot = index % slots
      piece = acc[rows, cols]  # [epilogue_m, epilogue_n] float32
      if self.p.accumulate:
        plgpu.barrier_wait(self._slot(index)[1])
        piece = piece + self.out_smem[slot].astype(jnp.float32)
      else:
        plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
      self.out_smem[slot] = piece.astype(self.p.out_dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(self.out_smem.at[slot], self.out_tile.at[rows, cols])
      if self.p.accumulate and index + slots < len(pieces):
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # this store read the slot
        self.load_addend(index + slots)


def _num_sms() -> int:
  return getattr(jax.devices()[0], "core_count", None) or 132


def _gemm(lhs, rhs, accumulate, problem: _Problem, config: GemmConfig):
  """Launches the kernel; ``accumulate`` (or None) is updated through a Ref.

  Split along K, the blocks write float32 partial products, summed here.
  """
  if config.k_splits > 1 and accumulate is not None:
    raise ValueError("split-K (k_splits > 1) does not accumulate")
  kernel_problem = problem
  if config.k_splits > 1:
    kernel_problem = dataclasses.replace(problem, out_dtype=jnp.dtype(jnp.float32))
  mesh = plgpu.Mesh(
    grid=(_num_sms(),), grid_names=("sm",), num_threads=3, thread_name="wg"
  )
  kernel = functools.partial(
    pl.kernel,
    functools.partial(_gemm_kernel, problem=kernel_problem, config=config),
    mesh=mesh,
    compiler_params=plgpu.CompilerParams(
      lowering_semantics=plgpu.LoweringSemantics.Warpgroup
    ),
    name="mst_jax_mosaic_gemm",
  )
  if config.k_splits > 1:
    shape = (config.k_splits, problem.m, problem.n)
    parts = kernel(out_type=jax.ShapeDtypeStruct(shape, jnp.float32))(lhs, rhs)
    return jnp.sum(parts, axis=0).astype(problem.out_dtype)
  if accumulate is None:
    out_type = jax.ShapeDtypeStruct((problem.m, problem.n), problem.out_dtype)
    return kernel(out_type=out_type)(lhs, rhs)
  out_ref = jax.new_ref(accumulate)
  kernel(out_type=())(lhs, rhs, out_ref)
  return jax.freeze(out_ref)


_STATIC_ARGS = ("dimension_numbers", "out_dtype", "config")


@functools.cache
def unavailable_reason() -> str | None:
  """Why the kernel cannot run on the default device, or None."""
  if _IMPORT_ERROR is not None:
    return f"jax.experimental.pallas.mosaic_gpu is not importable ({_IMPORT_ERROR})"
  device = jax.devices()[0]
  if device.platform != "gpu":
    return f"it needs a Hopper GPU, the default device is a {device.platform}"
  capability = getattr(device, "compute_capability", None)
  if capability != "9.0":
    return f"it needs a Hopper GPU (compute capability 9.0), got {capability}"
  return None


def takes(lhs, rhs, dimension_numbers, out_dtype, accumulate=None) -> bool:
  """Whether ``matmul`` runs these arguments here (a Hopper GPU, bf16/f16
  operands, arrays of whole TMA tiles); ``mst_jax._matmul`` uses
  ``lax.dot_general`` for the rest."""
  if unavailable_reason() is not None:
    return False
  try:
    _check(lhs, rhs, dimension_numbers, out_dtype, accumulate)
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
) -> jax.Array:
  """``lax.dot_general(lhs, rhs, dimension_numbers)`` (2-D) on Hopper's wgmma.

  Accumulates in float32 and rounds once to ``out_dtype``. Either operand may
  be contracted over its rows or its columns; neither is transposed in
  memory. The LM head's products, for ``hidden [N, D]``, ``dlogits [N, V]``
  and a weight ``[V, D]`` (``"vd"``) or ``[D, V]`` (``"dv"``), are those of
  ``mst_jax._matmul``::

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

  Returns:
    ``[M, N]`` in ``out_dtype``.

  Raises:
    ValueError: shapes that do not contract, or ``accumulate`` of another shape.
    TypeError: dtypes other than those above.
    NotImplementedError: no Hopper GPU, batch dimensions, or arrays that are
      not whole ``8 x 128``-byte tiles (see the module docstring).
  """
  if out_dtype is None:
    out_dtype = lhs.dtype if accumulate is None else accumulate.dtype
  problem = _check(lhs, rhs, dimension_numbers, out_dtype, accumulate)
  if (reason := unavailable_reason()) is not None:
    raise NotImplementedError(f"mosaic_gemm.matmul: {reason}; use lax.dot_general.")
  p = problem
  config = config or default_config(
    p.m, p.n, p.k, p.out_dtype, p.accumulate, _num_sms()
  )
  return _gemm(lhs, rhs, accumulate, problem, config)
