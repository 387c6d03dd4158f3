"""Per-chunk backends behind one interface (``base.ChunkBackend``).

``select`` and ``select_gemm`` are the one place that maps ``impl`` and the
platform to a backend and to what runs the matmuls.
"""

from __future__ import annotations

import functools
import warnings

import jax

from mst_jax._gemm.mosaic import gemm as mosaic_gemm
from mst_jax._kernels.base import (
  AllColumns,
  ChunkBackend,
  ChunkInputs,
  Columns,
  HeadSpec,
)
from mst_jax._kernels.xla import XlaChunkCE, XlaDistill

__all__ = [
  "AllColumns",
  "ChunkBackend",
  "ChunkInputs",
  "Columns",
  "HeadSpec",
  "XlaChunkCE",
  "XlaDistill",
  "pallas_unavailable_reason",
  "refuse_second_order",
  "select",
  "select_distill",
  "select_gemm",
]


@functools.cache
def pallas_unavailable_reason(platform: str) -> str | None:
  """Why the Pallas Triton kernels cannot run on ``platform``, or None.

  On a GPU this compiles a tiny kernel once per process: a jax without the
  Triton lowering fails here, not in the middle of a user's trace.
  """
  try:
    from mst_jax._kernels.triton import ce as triton_ce
  except ImportError as e:
    return f"jax.experimental.pallas.triton is not importable ({e})"
  if platform != "gpu":
    return None  # interpret mode needs no lowering
  try:
    triton_ce.smoke_test()
  except Exception as e:  # noqa: BLE001 -- any lowering failure means "unavailable"
    return f"the Pallas Triton lowering failed on this jax ({type(e).__name__}: {e})"
  return None


def _use_pallas(
  impl: str | None, platform: str, not_on_triton: str | None = None
) -> bool:
  """Whether ``impl`` on ``platform`` runs the Pallas Triton kernels.

  ``impl=None`` and ``"mosaic"``: on a GPU; ``"pallas"``: everywhere (in
  interpret mode off a GPU); ``"xla"``: never. If the Triton lowering is
  unavailable, a Pallas request falls back to XLA with one warning.
  ``not_on_triton`` names what the call computes that the Triton kernels do not
  (class weights with label smoothing): then XLA, or for ``impl="pallas"``
  an error.
  """
  if not_on_triton and impl == "pallas":
    raise NotImplementedError(
      f"impl='pallas' does not compute {not_on_triton}; use impl=None or impl='xla'."
    )
  if impl == "xla" or not_on_triton or (impl in (None, "mosaic") and platform != "gpu"):
    return False
  reason = pallas_unavailable_reason(platform)
  if reason is not None:
    _warn_fallback(reason)
    return False
  return True


def select(
  impl: str | None, platform: str, *, not_on_triton: str | None = None
) -> ChunkBackend:
  """The per-chunk cross-entropy backend for ``impl`` (None, "xla", "pallas"
  or "mosaic") on ``platform``.

  ``impl=None`` and ``"mosaic"`` on a Hopper GPU (where ``select_gemm``
  gives the Mosaic GEMMs): the Mosaic GPU kernels, with XLA's for what they
  do not take (float32 inputs, class weights), so Hopper never runs Pallas's
  deprecated Triton lowering unless asked. Otherwise the Pallas Triton
  kernels where ``_use_pallas`` says so, else XLA.
  """
  if impl in (None, "mosaic") and select_gemm(impl, platform) == "mosaic":
    from mst_jax._kernels.mosaic import ce as mosaic_ce

    return mosaic_ce.MosaicChunkCE()
  if not _use_pallas(impl, platform, not_on_triton):
    return XlaChunkCE(sum_by_product=platform == "cpu")
  from mst_jax._kernels.triton import ce as triton_ce

  return triton_ce.PallasTritonChunkCE(interpret=platform != "gpu")


def select_distill(impl: str | None, platform: str):
  """The per-chunk distillation kernel for ``impl`` on ``platform``, chosen as
  ``select`` chooses: ``mosaic.distill.MosaicDistill`` (with XLA's chunk for
  what it does not take), ``triton.distill.PallasTritonDistill`` or
  ``XlaDistill`` (``_math.distill.chunk_loss``)."""
  if impl in (None, "mosaic") and select_gemm(impl, platform) == "mosaic":
    from mst_jax._kernels.mosaic import distill as mosaic_distill

    return mosaic_distill.MosaicDistill()
  if not _use_pallas(impl, platform):
    return XlaDistill()
  from mst_jax._kernels.triton import distill as triton_distill

  return triton_distill.PallasTritonDistill(interpret=platform != "gpu")


def select_gemm(impl: str | None, platform: str) -> str:
  """What runs the head's matmuls (``_gemm.matmul``'s ``gemm``: "xla" or "mosaic")
  for ``impl``.

  ``impl=None`` and ``"mosaic"``: the Mosaic GPU kernel on a Hopper GPU,
  which is never autotuned (a step's first call needs no more memory than
  the next) and computes the cross-entropy's statistics in the logits
  GEMM's epilogue; elsewhere XLA's, with one warning for ``"mosaic"``.
  ``"xla"`` and ``"pallas"``: XLA's.
  """
  if impl not in (None, "mosaic"):
    return "xla"
  reason = mosaic_gemm.unavailable_reason()
  if platform != "gpu":
    reason = f"it needs a Hopper GPU, the platform is a {platform}"
  if reason is None:
    return "mosaic"
  if impl == "mosaic":
    _warn_fallback(reason, what="GEMMs")
  return "xla"


_INSTEAD = {
  "backend": "the XLA per-chunk backend instead of Pallas",
  "GEMMs": "XLA's GEMMs instead of Mosaic GPU's",
}


@functools.cache
def _warn_fallback(reason: str, what: str = "backend") -> None:
  warnings.warn(
    f"mst_jax: using {_INSTEAD[what]}: {reason}.", RuntimeWarning, stacklevel=4
  )


def refuse_second_order(arrays, kernels: bool):
  """``arrays`` (a custom VJP rule's inputs) unchanged, through an identity
  whose derivative raises a clear error if ``kernels`` run on them.

  A first derivative only calls the rules; a second one (a Hessian-vector
  product, ``jax.hessian``, a gradient of a gradient) differentiates them,
  as staged by ``jax.jit`` too. XLA's operations have derivatives, so the XLA
  backend gives the second derivative; the Pallas and Mosaic GPU kernels
  have none, and JAX would fail inside them with an internal error.
  """
  return _no_derivative(arrays) if kernels else arrays


@jax.custom_jvp
def _no_derivative(arrays):
  return arrays


@_no_derivative.defjvp
def _no_derivative_jvp(primals, tangents):
  raise NotImplementedError(
    "Second derivatives (a Hessian-vector product, jax.hessian, a gradient of"
    " a gradient) of this loss need impl='xla' or impl='reference': the"
    " Pallas and Mosaic GPU kernels have no derivatives of their own."
  )
