"""Heuristics: rows per chunk, and the Pallas kernels' block sizes."""

from __future__ import annotations

import dataclasses

import numpy as np

# The per-chunk temporaries (float32 logits, a float32 elementwise temporary and
# dlogits in the compute dtype) of one chunk stay under this many bytes.
DEFAULT_CHUNK_BYTES = 1 << 30

# Tensor cores want row counts in multiples of this.
_ROW_ALIGN = 128


def default_rows_per_chunk(
  n_rows: int,
  vocab_size: int,
  dtype: np.dtype,
  *,
  budget_bytes: int = DEFAULT_CHUNK_BYTES,
) -> int:
  """Rows per chunk whose temporaries fit ``budget_bytes``.

  Args:
    n_rows: ``N``, the number of rows (tokens); the result never exceeds it.
    vocab_size: ``V``.
    dtype: the compute dtype of the matmuls (that of ``dlogits``).
    budget_bytes: the byte budget of one chunk's temporaries.

  Returns:
    A positive row count: a multiple of 128 when the budget allows one, else a
    multiple of 8 (at least 8), capped at ``n_rows``.
  """
  bytes_per_row = vocab_size * (4 + 4 + np.dtype(dtype).itemsize)
  rows = budget_bytes // bytes_per_row
  align = _ROW_ALIGN if rows >= _ROW_ALIGN else 8
  rows = max(align, rows // align * align)
  return max(1, min(rows, n_rows))


def _is_power_of_2(value: int) -> bool:
  return isinstance(value, int) and value > 0 and value & (value - 1) == 0


@dataclasses.dataclass(frozen=True)
class KernelBlocks:
  """Block sizes of the Pallas cross-entropy kernels.

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

  def __post_init__(self):
    for name in ("block_rows", "block_v", "num_warps"):
      value = getattr(self, name)
      if not _is_power_of_2(value):
        raise ValueError(f"KernelBlocks.{name} must be a power of 2, got {value!r}.")
    if not (isinstance(self.num_stages, int) and self.num_stages >= 1):
      raise ValueError(
        f"KernelBlocks.num_stages must be >= 1, got {self.num_stages!r}."
      )


def default_kernel_blocks(vocab_size: int) -> KernelBlocks:
  """Heuristic kernel blocks for a vocabulary of ``vocab_size``.

  One row per program gives a chunk of ``R`` rows ``R`` independent programs
  (enough to fill the GPU at the chunk sizes we use) and keeps each program's
  reductions in registers. On the H200, 1 row x 2048 columns x 4 warps was the
  fastest statistics kernel in 3 of 4 chunk shapes (docs/benchmarks.md). The
  vocabulary step is capped by the (power-of-2) vocabulary so that small
  vocabularies do not load mostly padding.
  """
  block_v = min(2048, max(128, 1 << max(vocab_size - 1, 1).bit_length()))
  return KernelBlocks(block_rows=1, block_v=block_v, num_warps=4)
