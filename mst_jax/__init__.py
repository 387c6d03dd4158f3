"""mst_jax: the LM-head cross-entropy without the ``[tokens, vocab]`` logits.

``mst_jax.losses`` holds the losses that compose with the head's
log-probabilities (policy gradient, DPO, SimPO, ORPO, top-k distillation).

The Flax modules (``mst_jax.nnx``, ``mst_jax.linen`` and ``LMHeadLoss``, the
NNX one) are imported on first use, so ``import mst_jax`` does not import Flax.
"""

from __future__ import annotations

import importlib

from mst_jax import losses, reference
from mst_jax._args.inputs import LossAux
from mst_jax._args.options import HeadLossOptions, LossOptions, PerfOptions
from mst_jax._losses.cross_entropy import linear_cross_entropy
from mst_jax._losses.distillation import linear_distillation_loss
from mst_jax._losses.log_probs import linear_log_probs
from mst_jax._losses.top_k import linear_top_k
from mst_jax._math.ce import CEOptions

__version__ = "0.1.0"

__all__ = [
  "CEOptions",
  "HeadLossOptions",
  "LMHeadLoss",
  "LossAux",
  "LossOptions",
  "PerfOptions",
  "linear_cross_entropy",
  "linear_distillation_loss",
  "linear_log_probs",
  "linear_top_k",
  "linen",
  "losses",
  "nnx",
  "reference",
]

_FLAX_MODULES = ("linen", "nnx")


def __getattr__(name: str):
  if name in _FLAX_MODULES:
    return importlib.import_module(f"mst_jax.{name}")
  if name == "LMHeadLoss":
    return importlib.import_module("mst_jax.nnx").LMHeadLoss
  raise AttributeError(f"module 'mst_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(__all__)
