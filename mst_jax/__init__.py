"""mst_jax: the LM-head cross-entropy without the ``[tokens, vocab]`` logits."""

from mst_jax import linen, nnx, reference
from mst_jax.api import linear_cross_entropy
from mst_jax.ce_math import CEOptions
from mst_jax.head import HeadLossOptions
from mst_jax.inputs import LossAux
from mst_jax.nnx import LMHeadLoss

__version__ = "0.1.0"

__all__ = [
  "CEOptions",
  "HeadLossOptions",
  "LMHeadLoss",
  "LossAux",
  "linear_cross_entropy",
  "linen",
  "nnx",
  "reference",
]
