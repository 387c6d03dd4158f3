"""Per-chunk backends behind one interface (``base.ChunkBackend``).

``select`` is the one place that maps ``impl`` and the platform to a backend.
"""

from __future__ import annotations

import functools
import warnings

from mst_jax._backends.base import (
  AllColumns,
  ChunkBackend,
  ChunkInputs,
  Columns,
  HeadSpec,
)
from mst_jax._backends.xla import XlaChunkCE

__all__ = [
  "AllColumns",
  "ChunkBackend",
  "ChunkInputs",
  "Columns",
  "HeadSpec",
  "XlaChunkCE",
  "pallas_unavailable_reason",
  "select",
]


@functools.cache
def pallas_unavailable_reason(platform: str) -> str | None:
  """Why the Pallas Triton kernels cannot run on ``platform``, or None.

  On a GPU this compiles a tiny kernel once per process: a jax without the
  Triton lowering fails here, not in the middle of a user's trace.
  """
  try:
    from mst_jax._backends import pallas_triton
  except ImportError as e:
    return f"jax.experimental.pallas.triton is not importable ({e})"
  if platform != "gpu":
    return None  # interpret mode needs no lowering
  try:
    pallas_triton.smoke_test()
  except Exception as e:  # noqa: BLE001 -- any lowering failure means "unavailable"
    return f"the Pallas Triton lowering failed on this jax ({type(e).__name__}: {e})"
  return None


def select(
  impl: str | None, platform: str, *, xla_only: str | None = None
) -> ChunkBackend:
  """The per-chunk backend for ``impl`` (None, "xla" or "pallas") on ``platform``.

  ``impl=None`` picks the Pallas kernels on a GPU and XLA elsewhere;
  ``impl="pallas"`` on a CPU runs the kernels in interpret mode. If the Triton
  lowering is unavailable, a Pallas request falls back to XLA with one warning.
  ``xla_only`` names what the call computes that only the XLA backend does
  (the entropy, class weights): then XLA, or for ``impl="pallas"`` an error.
  """
  if xla_only and impl == "pallas":
    raise NotImplementedError(
      f"impl='pallas' does not compute {xla_only}; use impl=None or impl='xla'."
    )
  if impl == "xla" or xla_only or (impl is None and platform != "gpu"):
    return XlaChunkCE()
  reason = pallas_unavailable_reason(platform)
  if reason is not None:
    _warn_fallback(reason)
    return XlaChunkCE()
  from mst_jax._backends import pallas_triton

  return pallas_triton.PallasTritonChunkCE(interpret=platform != "gpu")


@functools.cache
def _warn_fallback(reason: str) -> None:
  warnings.warn(
    f"mst_jax: using the XLA per-chunk backend instead of Pallas: {reason}.",
    RuntimeWarning,
    stacklevel=4,
  )
