"""Per-chunk cross-entropy in plain XLA: whole-row reductions on ``[rows, V]``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mst_jax._kernels import base
from mst_jax._math import ce as ce_math
from mst_jax._math import distill as distill_math


@dataclasses.dataclass(frozen=True)
class XlaChunkCE(base.MatmulThenCE):
  """The logits GEMM, then the cross-entropy in jnp; XLA fuses the elementwise work.

  Attributes:
    sum_by_product: each row's sum of exponentials as a matrix-vector
      product, for XLA:CPU, which runs an exponential fused into a reduction
      several times slower than one it writes out for a product (a step at
      N=4096, D=64, V=151936, float32, 2 cores: 2.5 s instead of 3.5 s; the
      naive head's 2.8 s).
  """

  sum_by_product: bool = False

  def forward(
    self,
    logits: jax.Array,
    labels: jax.Array,
    options: ce_math.CEOptions,
    class_weights: jax.Array | None = None,
  ) -> ce_math.RowStats:
    vocab_size = logits.shape[-1]
    logits = ce_math.upcast(logits)
    capped = ce_math.scores(logits, options)  # [rows, V]
    row_max = jnp.max(capped, axis=-1)
    # A block whose scores are all -inf (banned tokens) has no mass: sum-exp
    # 0 and log-sum-exp -inf, not exp(-inf - -inf) = NaN.
    shift = ce_math.max_shift(row_max)
    unnormalized = jnp.exp(capped - shift[:, None])
    if self.sum_by_product:
      sum_exp = unnormalized @ jnp.ones(vocab_size, unnormalized.dtype)
    else:
      sum_exp = jnp.sum(unnormalized, axis=-1)
    log_sum_exp = jnp.log(sum_exp)
    safe_labels = jnp.clip(labels, 0, vocab_size - 1)
    target = jnp.take_along_axis(capped, safe_labels[:, None], axis=-1)[:, 0]
    mean_weight = None
    if not options.label_smoothing:
      mean_logit = jnp.zeros_like(row_max)
    elif class_weights is None:
      mean_logit = jnp.mean(capped, axis=-1)
    else:  # the class-weighted mean, and its weight for combining parts
      weights = class_weights.astype(capped.dtype)
      total = jnp.sum(weights)
      # A class of weight 0 adds 0, also where its score is -inf (banned).
      weighted = jnp.where(weights[None, :] > 0, capped * weights[None, :], 0.0)
      mean_logit = jnp.sum(weighted, axis=-1) / jnp.where(total > 0, total, 1.0)
      mean_weight = jnp.full_like(row_max, total)
    argmax = jnp.argmax(capped, axis=-1).astype(jnp.int32)
    expected = None
    if options.entropy:
      # A score of -inf (a banned token) has no mass and adds 0, not 0 * -inf.
      weighted = jnp.where(unnormalized > 0, unnormalized * capped, 0.0)
      expected = jnp.sum(weighted, axis=-1) / sum_exp
    return ce_math.RowStats(
      row_max,
      log_sum_exp,
      target,
      mean_logit,
      argmax,
      expected_score=expected,
      mean_weight=mean_weight,
    )

  def backward(
    self,
    logits: jax.Array,
    labels: jax.Array,
    rows: ce_math.BackwardRows,
    options: ce_math.CEOptions,
    out_dtype: jax.typing.DTypeLike,
    vocab_size: int | None = None,
    class_weights: jax.Array | None = None,
  ) -> jax.Array:
    cols = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    vocab_size = vocab_size or logits.shape[-1]
    if class_weights is not None:
      class_weights = class_weights.astype(ce_math.at_least_float32(logits.dtype))
    grad = ce_math.dlogits_block(
      ce_math.upcast(logits), cols, labels, rows, options, vocab_size, class_weights
    )
    return grad.astype(out_dtype)

  def forward_backward(
    self,
    logits: jax.Array,
    labels: jax.Array,
    valid: jax.Array,
    g_loss: jax.Array,
    options: ce_math.CEOptions,
    out_dtype: jax.typing.DTypeLike,
    *,
    into: tuple[jax.Array, jax.Array] | None = None,
    class_weights: jax.Array | None = None,
    classes: ce_math.ClassRows | None = None,
  ) -> tuple[ce_math.RowStats, jax.Array]:
    return base.unfused_forward_backward(
      self,
      logits,
      labels,
      valid,
      g_loss,
      options,
      out_dtype,
      into=into,
      class_weights=class_weights,
      classes=classes,
    )


@dataclasses.dataclass(frozen=True)
class XlaDistill(base.DistillKernel):
  """A chunk's distillation loss and ``dlogits`` in plain XLA
  (``_math.distill.chunk_loss``); the kernels' interface
  (``triton.distill.PallasTritonDistill``, ``mosaic.distill.MosaicDistill``).

  Attributes:
    work_bytes: what XLA holds a logit besides both heads' logits and
      ``dlogits``: two float32 arrays between its elementwise passes (XLA:CPU
      holds 12 to 16 bytes a logit in all; XLA:GPU fuses the passes and
      holds fewer).
  """

  work_bytes: int = 2 * 4

  def in_place(self, student_logits, teacher_logits, out_dtype) -> bool:
    """Never: XLA forms ``dlogits`` as a new array."""
    del student_logits, teacher_logits, out_dtype
    return False

  def chunk_loss(
    self, student_logits, teacher_logits, labels, valid, g_loss, options, out_dtype
  ):
    loss, dlogits = distill_math.chunk_loss(
      student_logits, teacher_logits, labels, valid, g_loss, options
    )
    return loss, None if dlogits is None else dlogits.astype(out_dtype)
