"""mst_jax: the LM-head cross-entropy without the ``[tokens, vocab]`` logits."""

from mst_jax import reference
from mst_jax.api import linear_cross_entropy
from mst_jax.ce_math import CEOptions
from mst_jax.inputs import LossAux

__version__ = "0.1.0"

__all__ = [
  "CEOptions",
  "LossAux",
  "linear_cross_entropy",
  "reference",
]
