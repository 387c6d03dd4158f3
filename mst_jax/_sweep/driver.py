"""The custom-VJP driver: the loss without ``[N, V]`` logits, and its gradient.

Two custom VJPs run a ``Plan`` (a loop order with its configuration):

* ``row_losses`` (the Mini-Sequence Transformer design): the forward keeps
  only the per-row lse; the backward recomputes each chunk's logits. Per-row
  outputs, so every reduction works, and the lse is differentiable. When all
  rows' logits fit the memory budget as one group (``Plan.keep_logits``), the
  forward keeps them instead and the backward forms ``dlogits`` over them.
* ``reduced_loss`` (gradient in the forward): for a scalar loss the forward
  forms the gradients in the same sweep as the loss; the backward only scales
  them by the incoming cotangent.

``symbolic_zeros=True`` tells the forward which inputs are differentiated; the
``dweight`` (or ``dhidden``, ``dbias``) matmul of a frozen input is not in the
program at all. The residuals have one structure whatever is differentiated
(``Differentiated.as_residual``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp

from mst_jax._kernels import XlaChunkCE, refuse_second_order
from mst_jax._sweep.rows import (
  Differentiated,
  Grads,
  Outputs,
  RowCotangents,
  RowInputs,
  SweepConfig,
  differentiated,
  scale_gradient,
  unwrap_primals,
)


class LoopOrder(Protocol):
  """How the rows (and columns) are walked: ``RowChunks``, ``VocabBlocks``,
  or either of them mapped over a mesh (``mst_jax._sweep.mesh.Sharded``)."""

  def forward(self, config: SweepConfig, x: RowInputs) -> Outputs:
    """Per-row ``(loss, lse, correct, entropy)``."""
    ...

  def backward(
    self, config: SweepConfig, x: RowInputs, cot: RowCotangents, diff: Differentiated
  ) -> Grads:
    """``(dhidden, dweight, dbias)`` of ``sum(loss * g_loss + lse * g_lse +
    entropy * g_entropy)``."""
    ...

  def fused(
    self, config: SweepConfig, x: RowInputs, row_scale: jax.Array, diff: Differentiated
  ) -> tuple[Outputs, Grads]:
    """``((sum(loss * row_scale), lse, correct, entropy), (dhidden, dweight,
    dbias))``."""
    ...


class Plan(NamedTuple):
  """A loop order and its configuration (a static, hashable value).

  ``keep_logits``: ``row_losses``' forward keeps the logits of all rows (per
  device, one ``[rows, columns]`` buffer of the compute dtype, which the
  planner fitted to the memory budget as a group) for the backward, which
  writes ``dlogits`` over them: 6 N·D·V FLOPs instead of 8. Needs an order
  with ``forward_keeping`` and ``backward_kept`` (``RowChunks``, on a mesh
  or not).
  """

  config: SweepConfig
  order: LoopOrder
  keep_logits: bool = False


def _runs_kernels(config: SweepConfig) -> bool:
  """Whether the sweep runs Pallas or Mosaic kernels (which have no
  derivatives, so no second derivative goes through them)."""
  return not (isinstance(config.backend, XlaChunkCE) and config.head.gemm == "xla")


def _instantiate(cotangent, like: jax.Array) -> jax.Array:
  if isinstance(cotangent, jax.custom_derivatives.SymbolicZero):
    return jnp.zeros_like(like)
  return cotangent


# ---- The recompute custom VJP: per-row outputs. ----


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def row_losses(plan: Plan, hidden, weight, bias, labels, valid, *classes):
  """Per-row loss, lse, argmax-correctness and entropy; the backward recomputes
  logits (or, with ``plan.keep_logits``, uses the forward's).

  Args:
    plan: a ``Plan``.
    hidden: ``[N, D]`` float.
    weight: ``[V, D]`` or ``[D, V]`` (``plan.config.layout``), hidden's dtype.
    bias: ``[V]`` float or None.
    labels: int32 ``[N]``.
    valid: bool ``[N]``; False rows give 0 loss, 0 lse and zero gradients.
    *classes: with class weights, ``RowInputs``' ``class_weights``,
      ``target_weight`` and ``mean_weight`` (not differentiated).

  Returns:
    ``(loss, lse, correct, entropy)``: ``[N]`` float32 (float64 for float64
    inputs), ``[N]`` float32, ``[N]`` bool and ``[N]`` float32 (zeros unless
    the options ask for the entropy). ``loss``, ``lse`` and ``entropy`` are
    differentiable.
  """
  x = RowInputs(hidden, weight, bias, labels, valid, *classes)
  return plan.order.forward(plan.config, x)


def _row_losses_fwd(plan: Plan, hidden, weight, bias, labels, valid, *classes):
  diff = differentiated(hidden, weight, bias)
  x = RowInputs(*unwrap_primals(hidden, weight, bias, labels, valid, *classes))
  x = refuse_second_order(x, _runs_kernels(plan.config))
  if plan.keep_logits:
    outputs, logits = plan.order.forward_keeping(plan.config, x)
  else:
    outputs, logits = plan.order.forward(plan.config, x), None
  no_classes = (None,) * len(classes)
  flags = diff.as_residual()
  return outputs, (x, outputs[1], outputs[3], flags, logits, no_classes)


def _row_losses_bwd(plan: Plan, residuals: tuple, cotangents: tuple) -> tuple:
  x, lse, entropy, flags, logits, no_classes = residuals
  diff = Differentiated.from_residual(flags)
  g_loss, g_lse, _, g_entropy = cotangents
  g_loss, g_lse, g_entropy = (_instantiate(g, lse) for g in (g_loss, g_lse, g_entropy))
  cot = RowCotangents(lse, g_loss, g_lse, entropy, g_entropy)
  if plan.keep_logits:
    grads = plan.order.backward_kept(plan.config, x, cot, diff, logits)
  else:
    grads = plan.order.backward(plan.config, x, cot, diff)
  return (*grads, None, None, *no_classes)  # labels, valid, class weights


row_losses.defvjp(_row_losses_fwd, _row_losses_bwd, symbolic_zeros=True)


# ---- The gradient-in-forward custom VJP: a scalar loss. ----


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def reduced_loss(plan: Plan, hidden, weight, bias, labels, valid, row_scale, *classes):
  """``sum(loss * row_scale)``, per-row lse and correctness; grads in the forward.

  Args:
    plan, hidden, weight, bias, labels, valid: as for ``row_losses``.
    row_scale: float32 ``[N]``, each row's weight in the scalar loss (for a
      mean, ``valid / n_valid``); not differentiated.
    *classes: as for ``row_losses``.

  Returns:
    ``(loss, lse, correct, entropy)``: the scalar loss, ``[N]`` lse, ``[N]``
    bool and ``[N]`` entropy. Only ``loss`` is differentiable:
    differentiating through ``lse`` raises (use ``row_losses``).
  """
  x = RowInputs(hidden, weight, bias, labels, valid, *classes)
  loss, *per_row = plan.order.forward(plan.config, x)
  return jnp.sum(loss * row_scale), *per_row


def _reduced_loss_fwd(
  plan: Plan, hidden, weight, bias, labels, valid, row_scale, *classes
):
  diff = differentiated(hidden, weight, bias)
  arrays = unwrap_primals(hidden, weight, bias, labels, valid, *classes)
  (row_scale,) = unwrap_primals(row_scale)
  x = RowInputs(*arrays)
  x = refuse_second_order(x, _runs_kernels(plan.config))
  outputs, grads = plan.order.fused(plan.config, x, row_scale, diff)
  no_classes = (None,) * len(classes)
  return outputs, (diff.fill(grads), diff.as_residual(), no_classes)


def _reduced_loss_bwd(plan: Plan, residuals: tuple, cotangents: tuple) -> tuple:
  del plan
  grads, flags, no_classes = residuals
  undifferentiated = (None, None, None, *no_classes)  # labels, valid, row_scale
  g_loss, g_lse, _, g_entropy = cotangents
  zero = jax.custom_derivatives.SymbolicZero
  if not (isinstance(g_lse, zero) and isinstance(g_entropy, zero)):
    raise NotImplementedError(
      "The per-token lse (aux.lse, aux.z_loss) is not differentiable with"
      " grad_mode='fused', which forms the gradient during the forward pass;"
      " use grad_mode='recompute' to differentiate through it."
    )
  if isinstance(g_loss, jax.custom_derivatives.SymbolicZero):
    return (None, None, None, *undifferentiated)

  scale = functools.partial(scale_gradient, g_loss=g_loss)
  grads = Differentiated.from_residual(flags).unfill(grads)
  dhidden, dweight, dbias = map(scale, grads)
  return (dhidden, dweight, dbias, *undifferentiated)


reduced_loss.defvjp(_reduced_loss_fwd, _reduced_loss_bwd, symbolic_zeros=True)
