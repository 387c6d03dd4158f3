"""What the Flax ``LMHeadLoss`` modules share: their calls.

``mst_jax.nnx.LMHeadLoss`` and ``mst_jax.linen.LMHeadLoss`` differ only in how
they hold parameters; both hold a ``HeadLossOptions`` and compute through
``head_loss``, ``head_log_probs`` and ``head_logits``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax.nnx.nn import dtypes

from mst_jax._args.options import HeadLossOptions
from mst_jax._losses.cross_entropy import linear_cross_entropy
from mst_jax._losses.log_probs import LOG_PROBS_FIXED, linear_log_probs
from mst_jax._math import ce as ce_math


class HeadParams(NamedTuple):
  """A head's parameters as a module holds them."""

  weight: jax.Array  # [D, V] kernel ("dv") or a tied [V, D] table ("vd")
  weight_layout: str
  bias: jax.Array | None


def _promoted(params: HeadParams, hidden: jax.Array, dtype) -> tuple:
  """``(hidden, weight, bias, weight_layout)``, promoted to ``dtype`` like
  Flax's Dense."""
  weight, weight_layout, bias = params
  hidden, weight, bias = dtypes.promote_dtype((hidden, weight, bias), dtype=dtype)
  return hidden, weight, bias, weight_layout


def _checked(options) -> HeadLossOptions:
  if not isinstance(options, HeadLossOptions):
    raise TypeError(
      "options must be a mst_jax.HeadLossOptions, got"
      f" {type(options).__name__}: pass HeadLossOptions(z_loss=...), or the"
      " options as keywords (LMHeadLoss.create(vocab_size, z_loss=...) in Linen)."
    )
  return options


def head_loss(
  params: HeadParams,
  hidden: jax.Array,
  labels: jax.Array,
  *,
  dtype,
  options: HeadLossOptions,
  where: jax.Array | None,
  token_weights: jax.Array | None,
  return_aux: bool,
  class_weights: jax.Array | None = None,
):
  """``linear_cross_entropy`` with the head's options."""
  options = _checked(options)
  hidden, weight, bias, weight_layout = _promoted(params, hidden, dtype)
  return linear_cross_entropy(
    hidden,
    weight,
    labels,
    bias,
    where=where,
    token_weights=token_weights,
    class_weights=class_weights,
    return_aux=return_aux,
    weight_layout=weight_layout,
    **dataclasses.asdict(options),
  )


def head_log_probs(
  params: HeadParams,
  hidden: jax.Array,
  labels: jax.Array,
  *,
  dtype,
  options: HeadLossOptions,
  where: jax.Array | None,
  return_entropy: bool,
):
  """``linear_log_probs`` with the head's options that apply to it (not the
  loss's reduction, smoothing or z-loss; a ``"fused"`` gradient mode, which
  needs a scalar loss, becomes the default)."""
  options = _checked(options)
  hidden, weight, bias, weight_layout = _promoted(params, hidden, dtype)
  options = {
    name: value
    for name, value in dataclasses.asdict(options).items()
    if name not in LOG_PROBS_FIXED
  }
  if options["grad_mode"] == "fused":
    options["grad_mode"] = None
  return linear_log_probs(
    hidden,
    weight,
    labels,
    bias,
    where=where,
    weight_layout=weight_layout,
    return_entropy=return_entropy,
    **options,
  )


def head_logits(
  params: HeadParams, hidden: jax.Array, *, dtype, options: HeadLossOptions
) -> jax.Array:
  """Full logits ``[..., V]`` in the computation dtype, scaled and softcapped
  like the loss's."""
  options = _checked(options)
  hidden, weight, bias, weight_layout = _promoted(params, hidden, dtype)
  kernel = weight if weight_layout == "dv" else weight.T
  logits = jnp.dot(hidden, kernel)
  if bias is not None:
    logits = logits + jnp.expand_dims(bias, tuple(range(logits.ndim - 1)))
  return ce_math.scores(logits, options.ce)
