"""What the Flax ``LMHeadLoss`` modules share: their loss options and calls.

``mst_jax.nnx.LMHeadLoss`` and ``mst_jax.linen.LMHeadLoss`` differ only in how
they hold parameters; both compute through ``head_loss`` and ``head_logits``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax.nnx.nn import dtypes

from mst_jax import api, ce_math, inputs


@dataclasses.dataclass(frozen=True)
class HeadLossOptions:
  """The ``linear_cross_entropy`` options a head module fixes at construction.

  See ``mst_jax.linear_cross_entropy`` for each; they are checked here, so a
  bad value fails when the module is built rather than at its first call.
  """

  ignore_index: int = -100
  reduction: str = "mean"
  label_smoothing: float = 0.0
  z_loss: float = 0.0
  logit_softcap: float | None = None
  chunk_size: int | None = None
  memory_budget: int | None = None
  vocab_block_size: int | None = None
  logits_dtype: jax.typing.DTypeLike | None = None
  impl: str | None = None
  grad_mode: str | None = None

  def __post_init__(self):
    inputs.check_int("ignore_index", self.ignore_index)
    if self.reduction not in inputs.REDUCTIONS:
      raise ValueError(
        f"reduction must be one of {inputs.REDUCTIONS}, got {self.reduction!r}."
      )
    ce_math.CEOptions(
      label_smoothing=inputs.check_finite_float(
        "label_smoothing", self.label_smoothing
      ),
      z_loss=inputs.check_finite_float("z_loss", self.z_loss),
      logit_softcap=None
      if self.logit_softcap is None
      else inputs.check_finite_float("logit_softcap", self.logit_softcap),
    )
    inputs.as_dtype("logits_dtype", self.logits_dtype)
    for name in ("chunk_size", "memory_budget", "vocab_block_size"):
      if getattr(self, name) is not None:
        inputs.check_int(name, getattr(self, name), minimum=1)
    if self.impl not in api.IMPLEMENTATIONS:
      raise ValueError(f"impl must be one of {api.IMPLEMENTATIONS}, got {self.impl!r}.")
    if self.grad_mode not in api.GRAD_MODES:
      raise ValueError(
        f"grad_mode must be one of {api.GRAD_MODES}, got {self.grad_mode!r}."
      )


class HeadParams(NamedTuple):
  """A head's parameters as a module holds them."""

  weight: jax.Array  # [D, V] kernel ("dv") or a tied [V, D] table ("vd")
  weight_layout: str
  bias: jax.Array | None


def head_loss(
  params: HeadParams,
  hidden: jax.Array,
  labels: jax.Array,
  *,
  dtype,
  options: HeadLossOptions,
  where: jax.Array | None,
  return_aux: bool,
):
  """``linear_cross_entropy`` with inputs promoted to ``dtype`` like Flax's Dense."""
  weight, weight_layout, bias = params
  hidden, weight, bias = dtypes.promote_dtype((hidden, weight, bias), dtype=dtype)
  return api.linear_cross_entropy(
    hidden,
    weight,
    labels,
    bias,
    where=where,
    weight_layout=weight_layout,
    return_aux=return_aux,
    **dataclasses.asdict(options),
  )


def head_logits(
  params: HeadParams, hidden: jax.Array, *, dtype, logit_softcap: float | None
) -> jax.Array:
  """Full logits ``[..., V]`` in the computation dtype, softcapped like the loss."""
  weight, weight_layout, bias = params
  hidden, weight, bias = dtypes.promote_dtype((hidden, weight, bias), dtype=dtype)
  kernel = weight if weight_layout == "dv" else weight.T
  logits = jnp.dot(hidden, kernel)
  if bias is not None:
    logits = logits + bias
  return ce_math.softcap(logits, logit_softcap)
