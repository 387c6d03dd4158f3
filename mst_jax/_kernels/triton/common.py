"""What the Pallas kernels lowered through Triton share: blocks, loads, the call.

Each kernel program owns ``block_rows`` rows of a chunk and walks the
vocabulary ``block_v`` columns at a time (``KernelBlocks``). On a CPU the
kernels run in interpret mode. The Triton lowering is deprecated from jax 0.11
in favour of Mosaic GPU; its warning is shown once per process.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from mst_jax._math.ce import at_least_float32

DEPRECATION = ".*Pallas Triton backend is deprecated"  # jax 0.11's warning
warnings.filterwarnings("once", message=DEPRECATION, category=DeprecationWarning)


def _is_power_of_2(value: int) -> bool:
  return isinstance(value, int) and value > 0 and value & (value - 1) == 0


@dataclasses.dataclass(frozen=True)
class KernelBlocks:
  """Block sizes of the Pallas kernels.

  Each program of the row-reduction kernels owns ``block_rows`` rows and walks
  the vocabulary ``block_v`` columns at a time; the elementwise ``dlogits``
  kernel tiles ``[block_rows, block_v]``.

  Attributes:
    block_rows: rows per program, a power of 2.
    block_v: vocabulary columns per step, a power of 2.
    num_warps: warps per program (Triton), a power of 2.
    num_stages: software-pipelining depth of the vocabulary loop (Triton).
  """

  block_rows: int = 1
  block_v: int = 2048
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self) -> None:
    power_of_2, at_least_1 = _is_power_of_2, lambda v: isinstance(v, int) and v >= 1
    checks = {"block_rows": power_of_2, "block_v": power_of_2}
    checks.update(num_warps=power_of_2, num_stages=at_least_1)
    for name, ok in checks.items():
      what = ">= 1" if ok is at_least_1 else "a power of 2"
      if not ok(value := getattr(self, name)):
        raise ValueError(f"KernelBlocks.{name} must be {what}, got {value!r}.")


def default_kernel_blocks(vocab_size: int) -> KernelBlocks:
  """Heuristic kernel blocks for a vocabulary of ``vocab_size``.

  One row per program: a chunk of ``R`` rows makes ``R`` programs, each with
  its reductions in registers; 1 row x 2048 columns x 4 warps was the fastest
  statistics kernel in 3 of 4 chunk shapes on the H200 (docs/benchmarks.md).
  Small vocabularies take a smaller (power-of-2) step, not mostly padding.
  """
  block_v = min(2048, max(128, 1 << max(vocab_size - 1, 1).bit_length()))
  return KernelBlocks(block_rows=1, block_v=block_v, num_warps=4)


def row_block(row_block_index, block_rows, n_rows):
  """The program's row slice and the mask of its rows below ``n_rows``."""
  rows = row_block_index * block_rows + jnp.arange(block_rows, dtype=jnp.int32)
  return pl.ds(row_block_index * block_rows, block_rows), rows < n_rows


def load_rows(ref, row_slice, row_mask, other):
  return plgpu.load(ref.at[row_slice], mask=row_mask, other=other)


def load_logits(logits_ref, row_slice, row_mask, col_block_index, block_v, dtype=None):
  """Block ``[block_rows, block_v]`` of logits (as ``dtype``, by default at
  least float32), its columns and their mask."""
  n_cols = logits_ref.shape[1]
  col_block_index = jnp.asarray(col_block_index, jnp.int32)  # int64 loops under x64
  cols = col_block_index * block_v + jnp.arange(block_v, dtype=jnp.int32)
  col_mask = cols < n_cols
  mask = row_mask[:, None] & col_mask[None, :]
  block = plgpu.load(
    logits_ref.at[row_slice, pl.ds(col_block_index * block_v, block_v)],
    mask=mask,
    other=0.0,
  )
  return block.astype(dtype or at_least_float32(logits_ref.dtype)), cols, col_mask


def row_scalar(values, row):
  """Element ``row`` of a program's ``[block_rows]`` vector, as a scalar."""
  return jnp.sum(jnp.where(jnp.arange(values.shape[0]) == row, values, 0))


def label_logits(logits_ref, labels, row_slice, row_mask):
  """Each row's logit at its label (at least float32), read one by one; any
  value where the label is outside ``[0, V)``."""
  n_cols = logits_ref.shape[1]
  dtype = at_least_float32(logits_ref.dtype)
  out = jnp.zeros(labels.shape, dtype)
  for row in range(labels.shape[0]):
    one_row = pl.ds(row_slice.start + row, 1)
    mask = jnp.full((1, 1), row_scalar(row_mask.astype(jnp.int32), row) != 0)
    label = jnp.clip(row_scalar(labels, row), 0, n_cols - 1)
    z = plgpu.load(logits_ref.at[one_row, pl.ds(label, 1)], mask=mask, other=0.0)
    out = jnp.where(jnp.arange(labels.shape[0]) == row, jnp.sum(z.astype(dtype)), out)
  return out


def call(kernel, name, grid, out_shape, blocks, n_inputs, *, interpret, aliases=None):
  """``pl.pallas_call`` of ``kernel(..., block_rows=, block_v=)`` over whole
  arrays (each program indexes its own rows)."""
  return pl.pallas_call(
    functools.partial(kernel, block_rows=blocks.block_rows, block_v=blocks.block_v),
    out_shape=out_shape,
    input_output_aliases=aliases or {},
    grid=grid,
    in_specs=[pl.no_block_spec] * n_inputs,
    out_specs=jax.tree.map(lambda _: pl.no_block_spec, out_shape),
    compiler_params=plgpu.CompilerParams(
      num_warps=blocks.num_warps, num_stages=blocks.num_stages
    ),
    interpret=interpret,
    name=name,
  )


@dataclasses.dataclass(frozen=True)
class TritonKernels:
  """Block sizes and mode of a backend's Pallas Triton kernels.

  Attributes:
    blocks: kernel block sizes; None picks ``default_kernel_blocks(V)``.
    interpret: run the kernels in Pallas interpret mode (on any backend,
      including a CPU); slow, for tests.
  """

  blocks: KernelBlocks | None = None
  interpret: bool = False

  def _call(self, kernel, name, grid, out_shape, vocab_size, n_inputs, *, aliases=None):
    """``call`` with this backend's blocks (``grid`` maps them to the grid)."""
    blocks = self.blocks or default_kernel_blocks(vocab_size)
    return call(
      kernel,
      name,
      grid(blocks),
      out_shape,
      blocks,
      n_inputs,
      interpret=self.interpret,
      aliases=aliases,
    )
