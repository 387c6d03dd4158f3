"""The two custom VJPs every chunked loss runs through, whatever its math.

A ``Plan`` (cross-entropy's: a loop order with its configuration, here;
distillation's: ``_sweep.distill.Plan``) says how to sweep a loss's arrays
``(hidden, weight, bias, *rest)``; only ``hidden``, ``weight`` and ``bias`` are
differentiated (``rest``: labels, validity, class weights, a teacher's head).

* ``row_losses`` (the Mini-Sequence Transformer design): the forward keeps
  its inputs and, where the plan asks, a few per-row outputs (cross-entropy's
  lse) or all rows' logits (``Plan.keep_logits``); the backward forms each
  chunk's ``dlogits`` again. Per-row outputs, so every reduction works.
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
from typing import Any, NamedTuple, Protocol

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


class SweepPlan(Protocol):
  """What the custom VJPs ask of a loss's plan (static, hashable)."""

  @property
  def runs_kernels(self) -> bool:
    """Whether the sweep runs Pallas or Mosaic kernels, which have no
    derivatives (so no second derivative goes through them)."""
    ...

  def inputs(self, *arrays) -> Any:
    """The sweep's inputs from ``(hidden, weight, bias, *rest)``."""
    ...

  def forward(self, x) -> tuple:
    """Per-row outputs, the loss first."""
    ...

  def forward_keeping(self, x) -> tuple[tuple, Any]:
    """``forward`` and what the backward reuses: ``(outputs, kept)``."""
    ...

  def saved(self, outputs: tuple) -> tuple:
    """The outputs the backward reads."""
    ...

  def backward(self, x, saved: tuple, cotangents: tuple, diff, kept) -> Grads:
    """``(dhidden, dweight, dbias)`` of the outputs weighted by ``cotangents``."""
    ...

  def fused(self, x, row_scale, diff) -> tuple[tuple, Grads]:
    """``((sum(loss * row_scale), *per_row), grads)``: the gradients of that sum."""
    ...

  def loss_cotangent(self, cotangents: tuple):
    """``reduced_loss``'s cotangent of the scalar loss (raising where the
    other outputs' are not zero: only the loss is differentiable there)."""
    ...


def _zero(cotangent) -> bool:
  return isinstance(cotangent, jax.custom_derivatives.SymbolicZero)


def _instantiate(cotangent, like: jax.Array) -> jax.Array:
  return jnp.zeros_like(like) if _zero(cotangent) else cotangent


# ---- The recompute custom VJP: per-row outputs. ----


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def row_losses(plan: SweepPlan, hidden, weight, bias, *rest):
  """``plan``'s per-row outputs of ``(hidden, weight, bias, *rest)``; the
  backward recomputes the logits (or, where the plan keeps them, reuses
  them). Only ``hidden``, ``weight`` and ``bias`` get cotangents."""
  return plan.forward(plan.inputs(hidden, weight, bias, *rest))


def _row_losses_fwd(plan: SweepPlan, hidden, weight, bias, *rest):
  diff = differentiated(hidden, weight, bias)
  x = plan.inputs(*unwrap_primals(hidden, weight, bias, *rest))
  x = refuse_second_order(x, plan.runs_kernels)
  outputs, kept = plan.forward_keeping(x)
  untouched = (None,) * len(rest)
  return outputs, (x, plan.saved(outputs), diff.as_residual(), kept, untouched)


def _row_losses_bwd(plan: SweepPlan, residuals: tuple, cotangents: tuple) -> tuple:
  x, saved, flags, kept, untouched = residuals
  if all(map(_zero, cotangents)):
    return (None, None, None, *untouched)
  diff = Differentiated.from_residual(flags)
  return (*plan.backward(x, saved, cotangents, diff, kept), *untouched)


row_losses.defvjp(_row_losses_fwd, _row_losses_bwd, symbolic_zeros=True)


# ---- The gradient-in-forward custom VJP: a scalar loss. ----


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def reduced_loss(plan: SweepPlan, row_scale, hidden, weight, bias, *rest):
  """``(sum(loss * row_scale), *per_row)``; the gradients formed in the forward.

  ``row_scale``: float32 ``[N]``, each row's weight in the scalar loss (for a
  mean, ``valid / n_valid``); not differentiated. Only the scalar is
  differentiable (``plan.loss_cotangent``).
  """
  loss, *per_row = plan.forward(plan.inputs(hidden, weight, bias, *rest))
  return jnp.sum(loss * row_scale.astype(loss.dtype)), *per_row


def _reduced_loss_fwd(plan: SweepPlan, row_scale, hidden, weight, bias, *rest):
  diff = differentiated(hidden, weight, bias)
  (row_scale,) = unwrap_primals(row_scale)
  x = plan.inputs(*unwrap_primals(hidden, weight, bias, *rest))
  x = refuse_second_order(x, plan.runs_kernels)
  outputs, grads = plan.fused(x, row_scale, diff)
  untouched = (None,) * len(rest)
  return outputs, (diff.fill(grads), diff.as_residual(), untouched)


def _reduced_loss_bwd(plan: SweepPlan, residuals: tuple, cotangents: tuple) -> tuple:
  grads, flags, untouched = residuals
  g_loss = plan.loss_cotangent(cotangents)
  if _zero(g_loss):
    return (None, None, None, None, *untouched)
  grads = Differentiated.from_residual(flags).unfill(grads)
  scale = functools.partial(scale_gradient, g_loss=g_loss)
  return (None, *map(scale, grads), *untouched)


reduced_loss.defvjp(_reduced_loss_fwd, _reduced_loss_bwd, symbolic_zeros=True)


# ---- Cross-entropy's plan: a loop order and its configuration. ----


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
  """Cross-entropy's ``SweepPlan``: a loop order and its configuration.

  The arrays are ``RowInputs``' ``(hidden, weight, bias, labels, valid,
  *classes, ids)``; the outputs per-row ``(loss, lse, correct, entropy)``:
  float32 (float64 for float64 inputs), float32, bool and float32 (zeros
  unless the options ask for the entropy), then with ids the ``[N, K]``
  logits at them; ``loss``, ``lse``, ``entropy`` and the logits at ids are
  differentiable through ``row_losses``, the loss alone through
  ``reduced_loss`` (which takes no ids).

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

  @property
  def runs_kernels(self) -> bool:
    config = self.config
    return not (isinstance(config.backend, XlaChunkCE) and config.head.gemm == "xla")

  def inputs(self, *arrays) -> RowInputs:
    return RowInputs(*arrays)

  def forward(self, x: RowInputs) -> Outputs:
    return self.order.forward(self.config, x)

  def forward_keeping(self, x: RowInputs):
    if self.keep_logits:
      return self.order.forward_keeping(self.config, x)
    return self.forward(x), None

  def saved(self, outputs: Outputs) -> tuple:
    _, lse, _, entropy, *_ = outputs
    return lse, entropy

  def backward(self, x: RowInputs, saved, cotangents, diff, kept) -> Grads:
    lse, entropy = saved
    g_loss, g_lse, _, g_entropy, *g_at_ids = cotangents
    g_loss, g_lse, g_entropy = (
      _instantiate(g, lse) for g in (g_loss, g_lse, g_entropy)
    )
    g_at_ids = None if not g_at_ids or _zero(g_at_ids[0]) else g_at_ids[0]
    cot = RowCotangents(lse, g_loss, g_lse, entropy, g_entropy, g_at_ids)
    if self.keep_logits:
      return self.order.backward_kept(self.config, x, cot, diff, kept)
    return self.order.backward(self.config, x, cot, diff)

  def fused(self, x: RowInputs, row_scale, diff):
    return self.order.fused(self.config, x, row_scale, diff)

  def loss_cotangent(self, cotangents):
    g_loss, g_lse, _, g_entropy = cotangents  # no ids: fused is for a scalar loss
    if not (_zero(g_lse) and _zero(g_entropy)):
      raise NotImplementedError(
        "The per-token lse (aux.lse, aux.z_loss) is not differentiable with"
        " grad_mode='fused', which forms the gradient during the forward pass;"
        " use grad_mode='recompute' to differentiate through it."
      )
    return g_loss
