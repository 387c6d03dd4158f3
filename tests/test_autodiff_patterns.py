"""Every public loss through the autodiff patterns of real training code, in
sequence, in one process, against the float64 oracle (tests/oracle.py).

JAX caches traces between these calls (a custom VJP's forward per pattern of
differentiated inputs, ``jit`` programs per signature), so each sequence uses
one loss callable throughout, as a training script does: gradients of every
subset of the differentiable arguments in several orders, ``jax.vjp`` with
Python, NumPy and JAX cotangents, ``jax.checkpoint`` with and without a
policy, ``jit``, ``value_and_grad``, gradient accumulation in a ``lax.scan``,
and a Hessian-vector product (XLA's backend; the kernels raise a clear error).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from conftest import GRAD_RTOL, LOSS_RTOL, assert_close

import mst_jax

# Unaligned sizes: chunks of 8 rows leave a partial one, V is no multiple of
# a tile. The Mosaic kernels take whole 64-column D.
N, V = 36, 301
MICROBATCHES = 3  # for the accumulation pattern: N / 3 rows each


def _dim(impl):
  return 64 if impl in ("mosaic", None) else 24


def _dtype(impl):
  # The Mosaic kernels take 16-bit inputs (float32 ones take other kernels).
  return jnp.bfloat16 if impl in ("mosaic", None) else jnp.float32


def _tolerances(dtype):
  """(loss, gradient) relative tolerances: the dtype's, and for bfloat16
  logits one far below a dropped term or a zero gradient (error 1)."""
  name = jnp.dtype(dtype).name
  if name == "bfloat16":
    return 1e-2, 3e-2
  return LOSS_RTOL[name] * 10, GRAD_RTOL[name]


# ---- The losses, as functions of their differentiable arguments. ----


class Case:
  """A public loss with its data fixed: ``library(*args)`` (``impl`` and
  options bound) and ``oracle(*args)`` take the same differentiable arguments
  (hidden, weight, bias; the student's for distillation)."""

  def __init__(self, name, rng, impl, grad_mode, dtype):
    dim = _dim(impl)
    self.name, self.dtype = name, dtype
    self.hidden = rng.standard_normal((N, dim))
    self.weight = rng.standard_normal((V, dim)) * 2.0 / np.sqrt(dim)
    self.bias = rng.standard_normal(V) * 0.3
    self.labels = rng.integers(0, V, N)
    self.where = rng.random(N) > 0.3
    self.teacher_hidden = rng.standard_normal((N, 32))
    self.teacher_weight = rng.standard_normal((V, 32)) * 2.0 / np.sqrt(32)
    # Weights of the per-token log-probs (all negative) and entropies (all
    # positive) in linear_log_probs' scalar: of opposite signs, so that the
    # scalar does not cancel. bfloat16 logits move each log-prob by up to
    # 2^-8 of the logits' size; random signs summed near 0 (-1.02 for seed
    # 1657917444) made that a 5.8% error of the scalar.
    self.cotangents = rng.uniform(0.5, 1.5, (2, N)) * np.array([[1.0], [-1.0]])
    self.perf = dict(impl=impl, grad_mode=grad_mode, chunk_size=8)

  def args(self, dtype=None):
    dtype = dtype or self.dtype
    return tuple(jnp.asarray(x, dtype) for x in (self.hidden, self.weight, self.bias))

  def library(self, hidden, weight, bias):
    return self._call(hidden, weight, bias, lib=True)

  def oracle(self, hidden, weight, bias):
    return self._call(hidden, weight, bias, lib=False)

  def _call(self, hidden, weight, bias, *, lib):
    labels, where = jnp.asarray(self.labels), jnp.asarray(self.where)
    options = dict(where=where, logit_softcap=20.0)
    if self.name == "cross_entropy":
      fn = mst_jax.linear_cross_entropy if lib else oracle.cross_entropy
      extra = dict(label_smoothing=0.1, z_loss=1e-3)
      return fn(hidden, weight, labels, bias, **options, **extra, **self._perf(lib))
    if self.name == "log_probs":
      fn = mst_jax.linear_log_probs if lib else oracle.log_probs
      out = fn(
        hidden, weight, labels, bias, return_entropy=True, **options, **self._perf(lib)
      )
      return self._dot(out)
    fn = mst_jax.linear_distillation_loss if lib else oracle.distillation
    teacher = (self.teacher_hidden, self.teacher_weight)
    teacher = tuple(jnp.asarray(x, hidden.dtype) for x in teacher)
    return fn(
      hidden, weight, *teacher, labels, student_bias=bias, divergence="jsd",
      hard_label_weight=0.5, **options, **self._perf(lib),
    )  # fmt: skip

  def _perf(self, lib):
    return self.perf if lib else {}

  def _dot(self, outputs):
    """A scalar of the per-token outputs (log-probs and entropies): their
    dot with fixed random cotangents."""
    log_probs, entropy = outputs
    c = jnp.asarray(self.cotangents, log_probs.dtype)
    return jnp.sum(log_probs * c[0]) + jnp.sum(entropy * c[1])

  def per_token(self, lib):
    """``(hidden, weight, bias) -> per-token outputs``: log-probs for
    ``linear_log_probs``, the ``reduction="none"`` loss for the others (whose
    gradients the fused mode cannot form: the default mode there)."""
    perf = self._perf(lib)
    if perf.get("grad_mode") == "fused":
      perf = {**perf, "grad_mode": None}
    if self.name == "log_probs":
      fn = mst_jax.linear_log_probs if lib else oracle.log_probs
      labels, where = jnp.asarray(self.labels), jnp.asarray(self.where)
      return lambda h, w, b: fn(h, w, labels, b, where=where, **perf)
    if self.name == "cross_entropy":
      fn = mst_jax.linear_cross_entropy if lib else oracle.cross_entropy
      labels, where = jnp.asarray(self.labels), jnp.asarray(self.where)
      return lambda h, w, b: fn(h, w, labels, b, where=where, reduction="none", **perf)
    fn = mst_jax.linear_distillation_loss if lib else oracle.distillation
    labels, where = jnp.asarray(self.labels), jnp.asarray(self.where)

    def per_token(h, w, b):
      teacher = tuple(
        jnp.asarray(x, h.dtype) for x in (self.teacher_hidden, self.teacher_weight)
      )
      return fn(
        h, w, *teacher, labels, student_bias=b, where=where, reduction="none",
        **perf,
      )  # fmt: skip

    return per_token


# ---- The patterns: each maps (a loss of (hidden, weight, bias), the case,
# the arguments) to a pytree of arrays, run alike on the library and the oracle.


SUBSETS = [(0,), (1,), (0, 1), (2,), (1, 2), (0, 2), (0, 1, 2)]


def _grads_by_subset(loss, case, args, lib):
  """Gradients over every subset of (hidden, weight, bias). After each new
  subset, the earlier ones it leaves out run again by ``jax.grad``, by
  ``jax.vjp`` pulled back with a Python float and through ``jax.checkpoint``:
  JAX reuses their cached forwards right after tracing one of another
  pattern, and some of these calls trace a new backward."""
  out, seen = [], []
  for argnums in SUBSETS:
    out.append(jax.grad(loss, argnums=argnums)(*args))
    for earlier in seen:
      if not set(earlier) <= set(argnums):
        out.extend(_again(loss, args, earlier))
    seen.append(argnums)
  return out


def _again(loss, args, argnums):
  def of_some(*some):
    full = list(args)
    for i, x in zip(argnums, some, strict=True):
      full[i] = x
    return loss(*full)

  _, pull = jax.vjp(of_some, *(args[i] for i in argnums))
  return (
    jax.grad(loss, argnums=argnums)(*args),
    pull(1.0),
    jax.grad(jax.checkpoint(loss), argnums=argnums)(*args),
  )


def _cotangent(kind, dtype):
  if kind == "python":
    return 1.5
  if kind == "numpy":
    return np.asarray(1.5, dtype)
  return jnp.asarray(1.5, dtype)


def _vjps(loss, case, args, lib):
  """Pullbacks of the scalar loss (hidden alone, then weight alone, then both)
  with each kind of cotangent, and of the per-token outputs with NumPy and
  JAX arrays."""
  hidden, weight, bias = args
  out = []
  for kind in ("python", "numpy", "jax"):
    value, pull = jax.vjp(lambda h: loss(h, weight, bias), hidden)
    out.append(pull(_cotangent(kind, value.dtype)))
    value, pull = jax.vjp(lambda w: loss(hidden, w, bias), weight)
    out.append(pull(_cotangent(kind, value.dtype)))
    value, pull = jax.vjp(loss, *args)
    out.append(pull(_cotangent(kind, value.dtype)))
  per_token = case.per_token(lib)
  values, pull = jax.vjp(lambda h, w: per_token(h, w, bias), hidden, weight)
  c = case.cotangents[0]
  out.append(pull(np.asarray(c, values.dtype)))
  out.append(pull(jnp.asarray(c, values.dtype)))
  return out


def _checkpointed(loss, case, args, lib):
  policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  return [
    jax.grad(jax.checkpoint(loss), argnums=(0,))(*args),
    jax.grad(jax.checkpoint(loss, policy=policy), argnums=(0, 1, 2))(*args),
    jax.grad(jax.checkpoint(loss), argnums=(1,))(*args),
    jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0,)))(*args),
  ]


def _jitted(loss, case, args, lib):
  return [
    jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*args),
    jax.jit(jax.grad(loss, argnums=(1,)))(*args),
    jax.value_and_grad(jax.jit(loss), argnums=(0,))(*args),
    jax.jit(loss)(*args),
  ]


def _accumulated(loss, case, args, lib):
  """Loss, weight and bias gradients summed over microbatches of rows in a
  ``lax.scan`` (each microbatch's own loss: gradient accumulation)."""
  hidden, weight, bias = args
  size = N // MICROBATCHES
  xs = (
    hidden.reshape(MICROBATCHES, size, hidden.shape[-1]),
    jnp.asarray(case.labels).reshape(MICROBATCHES, size),
    jnp.asarray(case.where).reshape(MICROBATCHES, size),
  )
  per_micro = _microbatch_loss(case, lib)

  def body(carry, x):
    h, labels, where = x
    value, grads = jax.value_and_grad(per_micro, argnums=(1, 2))(
      h, weight, bias, labels, where
    )
    return jax.tree.map(jnp.add, carry, (value, grads)), None

  value = jnp.zeros((), jnp.result_type(loss(*args)))
  total, _ = jax.lax.scan(
    body, (value, (jnp.zeros_like(weight), jnp.zeros_like(bias))), xs
  )
  return total


def _microbatch_loss(case, lib):
  """``(hidden, weight, bias, labels, where) -> loss`` of one microbatch
  (traced labels and mask), as the case's loss."""
  perf = case.perf if lib else {}
  if case.name == "cross_entropy":
    fn = mst_jax.linear_cross_entropy if lib else oracle.cross_entropy
    return lambda h, w, b, y, m: fn(
      h, w, y, b, where=m, logit_softcap=20.0, label_smoothing=0.1, z_loss=1e-3, **perf
    )
  if case.name == "log_probs":
    fn = mst_jax.linear_log_probs if lib else oracle.log_probs
    return lambda h, w, b, y, m: jnp.mean(
      fn(h, w, y, b, where=m, logit_softcap=20.0, **perf)
    )
  fn = mst_jax.linear_distillation_loss if lib else oracle.distillation
  teacher_weight = case.teacher_weight

  def distill(h, w, b, y, m):
    # The teacher's rows: a fixed projection of the student's, so that they
    # follow the microbatch without a second scanned array.
    t = jnp.tanh(h[:, :1]) * jnp.ones((1, teacher_weight.shape[1]), h.dtype)
    t = jax.lax.stop_gradient(t)
    return fn(
      h, w, t, jnp.asarray(teacher_weight, h.dtype), y, student_bias=b, where=m,
      logit_softcap=20.0, divergence="jsd", hard_label_weight=0.5, **perf,
    )  # fmt: skip

  return distill


def _hessian_vector_products(loss, case, args, lib):
  hidden, weight, bias = args
  direction = (
    jnp.asarray(np.cos(np.arange(hidden.size)).reshape(hidden.shape), hidden.dtype),
  )
  grads = lambda h: jax.grad(loss, argnums=(0, 1))(h, weight, bias)
  _, forward_over_reverse = jax.jvp(grads, (hidden,), direction)
  reverse_over_reverse = jax.grad(lambda h: jnp.vdot(grads(h)[1], grads(h)[1]))(hidden)
  return forward_over_reverse, reverse_over_reverse


PATTERNS = {
  "grad_subsets": _grads_by_subset,
  "vjp": _vjps,
  "checkpoint": _checkpointed,
  "jit": _jitted,
  "accumulate": _accumulated,
}


def _run_sequence(case, impl):
  """Runs every pattern in order on the library (one loss callable) and on
  the oracle in float64, comparing each result; then a Hessian-vector
  product, which XLA's backend gives and the kernels refuse."""
  loss_rtol, grad_rtol = _tolerances(case.dtype)
  patterns = dict(PATTERNS)
  if impl != "xla":
    with pytest.raises(NotImplementedError, match="Second derivatives"):
      _hessian_vector_products(case.library, case, case.args(), True)
  else:
    patterns["hvp"] = _hessian_vector_products
  for name, pattern in patterns.items():
    got = pattern(case.library, case, case.args(), True)
    with jax.enable_x64(True):
      want = pattern(case.oracle, case, case.args(jnp.float64), False)
      want = jax.tree.map(np.asarray, want)
    _compare(got, want, loss_rtol, grad_rtol * (10 if name == "hvp" else 1), name)


def _compare(got, want, loss_rtol, grad_rtol, what):
  got_leaves, got_tree = jax.tree.flatten(got)
  want_leaves, want_tree = jax.tree.flatten(want)
  assert got_tree == want_tree, (what, got_tree, want_tree)
  for i, (g, w) in enumerate(zip(got_leaves, want_leaves, strict=True)):
    rtol = loss_rtol if np.ndim(w) == 0 else grad_rtol
    assert np.any(w != 0) or np.ndim(w) == 0, f"{what}[{i}]: the oracle is zero"
    assert_close(g, w, rtol, f"{what}[{i}]", atol=1e-7 if np.ndim(w) == 0 else 0.0)


# ---- The tests. ----


FUNCTIONS = ["cross_entropy", "log_probs", "distillation"]
GRAD_MODES = {
  "cross_entropy": ["fused", "recompute"],
  "log_probs": [None, "recompute"],  # None: the forward's logits kept
  "distillation": ["fused", "recompute"],
}
CASES = [(fn, mode) for fn in FUNCTIONS for mode in GRAD_MODES[fn]]


@pytest.mark.parametrize("function,grad_mode", CASES)
def test_grad_of_hidden_after_grad_of_weight(rng, function, grad_mode):
  """The short sequence that returned a zero ``dhidden`` (or raised) when the
  custom VJPs' residuals followed the differentiated inputs: ``dhidden``,
  ``dweight``, then ``dhidden`` by ``jax.vjp`` and through ``jax.checkpoint``."""
  case = Case(function, rng, "xla", grad_mode, jnp.float32)
  hidden, weight, bias = case.args()
  with jax.enable_x64(True):
    want = jax.grad(case.oracle)(*case.args(jnp.float64))
  loss = case.library
  jax.grad(loss, argnums=0)(hidden, weight, bias)
  jax.grad(loss, argnums=1)(hidden, weight, bias)
  _, pull = jax.vjp(lambda h: loss(h, weight, bias), hidden)
  (by_vjp,) = pull(1.0)
  by_checkpoint = jax.grad(jax.checkpoint(loss))(hidden, weight, bias)
  for got in (by_vjp, by_checkpoint):
    assert_close(got, want, GRAD_RTOL["float32"], "dhidden")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("function", FUNCTIONS)
def test_hessian_vector_products(rng, function, dtype):
  """Second derivatives through the sweep's backward pass (XLA's backend),
  with masked tokens, whose rows the sweep moves: forward over reverse and
  reverse over reverse, against the oracle's."""
  case = Case(function, rng, "xla", None, dtype)
  got = _hessian_vector_products(case.library, case, case.args(), True)
  with jax.enable_x64(True):
    want = _hessian_vector_products(case.oracle, case, case.args(jnp.float64), False)
    want = jax.tree.map(np.asarray, want)
  _compare(got, want, *_tolerances(dtype), "hvp")


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["xla", "pallas", "mosaic"])
@pytest.mark.parametrize("function,grad_mode", CASES)
def test_autodiff_sequence_matches_the_oracle(request, rng, function, grad_mode, impl):
  """XLA, and the Pallas and Mosaic GPU kernels in interpret mode."""
  if impl == "mosaic":
    request.getfixturevalue("mosaic_on_cpu")
  _run_sequence(Case(function, rng, impl, grad_mode, _dtype(impl)), impl)


@pytest.mark.gpu
@pytest.mark.parametrize(
  "function,grad_mode,impl",
  [(*case, None) for case in CASES] + [("cross_entropy", "recompute", "xla")],
)
def test_autodiff_sequence_on_the_gpu(rng, function, grad_mode, impl):
  """The default implementation (the Mosaic GPU kernels on Hopper), and XLA's
  for its Hessian-vector products."""
  _run_sequence(Case(function, rng, impl, grad_mode, _dtype(impl)), impl)


def test_the_frozen_weight_compiles_without_a_dweight_product(rng):
  """After gradients of every subset (caches warm), the compiled gradient
  with respect to hidden alone holds no ``[V, D]`` product."""
  case = Case("cross_entropy", rng, "xla", "fused", jnp.float32)
  args = case.args()
  for argnums in ((0,), (1,), (0, 1, 2)):
    jax.grad(case.library, argnums=argnums)(*args)
  for mode in ("fused", "recompute"):
    case.perf["grad_mode"] = mode
    hlo = jax.jit(jax.grad(case.library, argnums=0)).lower(*args).compile().as_text()
    dweight_shape = f"f32[{V},{args[1].shape[1]}]"
    dots = [line for line in hlo.splitlines() if " dot(" in line]
    assert dots and not any(dweight_shape in line.split("=")[0] for line in dots), mode
