"""Chunking heuristics: how many rows a chunk holds."""

from __future__ import annotations

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
