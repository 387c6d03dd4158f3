"""Edge cases, determinism, transformations and property tests.

Every row of the table in docs/errors.md has a test here or in
test_validation.py / test_linear_cross_entropy.py (named in the table).
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import oracle as oracle64
import pytest
from conftest import (
  GRAD_RTOL,
  LOSS_RTOL,
  ON_GPU,
  assert_close,
  check_against_oracle,
  make_problem,
  oracle,
  to64,
  value_and_grads,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mst_jax


def _finite(*arrays):
  return all(np.isfinite(np.asarray(a, np.float32)).all() for a in arrays)


# ---- Numeric edge cases. ----


def test_one_token(rng, impl):
  problem = make_problem(rng, (1,), mask="none", bias=True)
  check_against_oracle(problem, "float32", impl=impl, z_loss=1e-3)


def test_vocab_smaller_than_one_kernel_block(rng, impl):
  problem = make_problem(rng, (2, 9), vocab=37, mask="scattered")
  check_against_oracle(problem, "float32", impl=impl, label_smoothing=0.1)


@pytest.mark.parametrize("grad_mode", ["fused", "recompute"])
def test_float32_logits_of_magnitude_1e4(rng, impl, grad_mode):
  """No inf or NaN; the error is float32 rounding of 1e4-sized logits."""
  problem = make_problem(rng, (3, 7), mask="none", logit_scale=1e4)
  loss, grads = value_and_grads(
    mst_jax.linear_cross_entropy, problem, impl=impl, grad_mode=grad_mode
  )
  assert _finite(loss, *grads)
  ref_loss, ref_grads = oracle(problem)
  assert_close(loss, ref_loss, 1e-5, "loss")
  for g, r in zip(grads, ref_grads, strict=True):
    assert_close(g, r, 4e-3, "grad")  # p = exp(s - lse): ulp(1e4) ~ 1e-3


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_logits_beyond_the_input_dtype_range(rng, impl, dtype):
  """Logits of ~2e5 overflow float16 (max 65504): they are float32 inside.

  (float32 is the default for float16 inputs; bfloat16 ones default to
  bfloat16 logits, which cannot overflow but round: float32 is asked for.)
  """
  problem = make_problem(rng, (3, 7), dtype=dtype, mask="none")
  problem.hidden = (problem.hidden * 100).astype(dtype)
  problem.weight = (problem.weight * 300).astype(dtype)
  logits = to64(problem.hidden) @ to64(problem.weight).T
  assert np.abs(logits).max() > 65504
  loss, grads = value_and_grads(
    mst_jax.linear_cross_entropy, problem, impl=impl, logits_dtype=jnp.float32
  )
  assert _finite(loss, *grads)
  ref_loss, _ = oracle(problem)
  assert_close(loss, ref_loss, 1e-5, "loss")


def test_softcap_with_extreme_logits(rng, impl):
  """tanh saturates: the loss is finite and the softcap derivative ~0."""
  problem = make_problem(rng, (3, 7), mask="none", logit_scale=1e4)
  check_against_oracle(
    problem, "float32", impl=impl, logit_softcap=30.0, loss_rtol=1e-5, grad_rtol=1e-4
  )


@pytest.mark.parametrize("label_smoothing", [0.0, 1.0])
def test_label_smoothing_at_its_ends(rng, impl, label_smoothing):
  problem = make_problem(rng, (3, 7), bias=True)
  check_against_oracle(problem, "float32", impl=impl, label_smoothing=label_smoothing)


def test_z_loss_with_a_large_lse(rng, impl):
  problem = make_problem(rng, (3, 7), bias=True)
  problem.bias = problem.bias + 60.0  # lse ~ 60 + log V
  check_against_oracle(problem, "float32", impl=impl, z_loss=1e-2)


@pytest.mark.parametrize("where", ["hidden", "weight"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_and_inf_inputs_reach_the_loss(rng, impl, where, bad):
  """A non-finite input of a valid token is never masked away."""
  problem = make_problem(rng, (3, 7), mask="none")
  if where == "hidden":
    problem.hidden = problem.hidden.at[1, 2, 0].set(bad)
  else:
    problem.weight = problem.weight.at[5, 0].set(bad)
  loss = mst_jax.linear_cross_entropy(*problem.args, impl=impl)
  assert not np.isfinite(float(loss))


@pytest.mark.parametrize("grad_mode", ["fused", "recompute"])
def test_inputs_differing_only_at_masked_tokens(rng, impl, grad_mode):
  """Identical loss and identical gradients on the rows that count, bit for bit."""
  problem = make_problem(rng, (4, 9), mask="scattered", bias=True)
  masked = ~np.asarray(problem.where)
  other = make_problem(rng, (4, 9), mask="none")
  hidden = np.asarray(problem.hidden).copy()
  hidden[masked] = np.asarray(other.hidden)[masked]
  hidden[np.argwhere(masked)[0][0], np.argwhere(masked)[0][1], 0] = np.nan
  labels = np.asarray(problem.labels).copy()
  labels[masked] = -7  # would be an error at a valid token
  variant = make_problem(rng, (4, 9))
  variant.hidden, variant.weight, variant.bias = (
    jnp.asarray(hidden),
    problem.weight,
    problem.bias,
  )
  variant.labels, variant.where = jnp.asarray(labels), problem.where
  kw = dict(impl=impl, chunk_size=8, grad_mode=grad_mode, z_loss=1e-3)
  loss_a, grads_a = value_and_grads(mst_jax.linear_cross_entropy, problem, **kw)
  loss_b, grads_b = value_and_grads(mst_jax.linear_cross_entropy, variant, **kw)
  np.testing.assert_array_equal(loss_a, loss_b)
  np.testing.assert_array_equal(
    np.asarray(grads_a[0])[~masked], np.asarray(grads_b[0])[~masked]
  )
  np.testing.assert_array_equal(np.asarray(grads_b[0])[masked], 0.0)
  for a, b in zip(grads_a[1:], grads_b[1:], strict=True):
    np.testing.assert_array_equal(a, b)


# ---- Determinism. ----

_DETERMINISM_SCRIPT = """
import hashlib, sys
import jax, jax.numpy as jnp, numpy as np
import mst_jax
rng = np.random.default_rng(1234)
hidden = jnp.asarray(rng.standard_normal((4, 33, 48)), jnp.bfloat16)
weight = jnp.asarray(rng.standard_normal((2053, 48)) * 0.2, jnp.bfloat16)
labels = jnp.asarray(rng.integers(0, 2053, (4, 33)), jnp.int32)
where = jnp.asarray(rng.random((4, 33)) > 0.3)
loss, grads = jax.jit(jax.value_and_grad(
    lambda h, w: mst_jax.linear_cross_entropy(h, w, labels, where=where,
        chunk_size=16, impl=sys.argv[1], z_loss=1e-3), argnums=(0, 1)))(hidden, weight)
digest = hashlib.sha256()
for x in (loss, *grads):
  digest.update(np.asarray(x.astype(jnp.float32)).tobytes())
print(digest.hexdigest())
"""


def _digest_in_fresh_process(impl, xla_flags=None):
  env = dict(os.environ)
  if xla_flags:
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + xla_flags).strip()
  result = subprocess.run(
    [sys.executable, "-c", _DETERMINISM_SCRIPT, impl],
    capture_output=True,
    text=True,
    check=True,
    env=env,
  )
  return result.stdout.strip().splitlines()[-1]


def _check_determinism(impl):
  namespace = {}
  digests = []
  for _ in range(2):
    # Same code as the fresh processes run, twice in this process.
    script = _DETERMINISM_SCRIPT.replace(
      "print(digest.hexdigest())", "out = digest.hexdigest()"
    )
    saved = sys.argv
    sys.argv = ["-", impl]
    try:
      exec(compile(script, "<determinism>", "exec"), namespace)
    finally:
      sys.argv = saved
    digests.append(namespace["out"])
  digests += [_digest_in_fresh_process(impl) for _ in range(2)]
  assert len(set(digests)) == 1, digests


def test_bitwise_deterministic_on_cpu():
  if ON_GPU:
    pytest.skip("the GPU variant is test_bitwise_deterministic_on_gpu")
  _check_determinism("xla")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_bitwise_deterministic_on_gpu(impl):
  """Within a process as on the CPU; across processes with deterministic ops.

  Each process autotunes its GEMMs, and two processes may pick cuBLAS
  algorithms that round differently (seen on the H200: 1 digest of 4 differed
  for impl="xla"); ``--xla_gpu_deterministic_ops=true`` pins them. mst_jax
  itself has no scheduling-dependent accumulation (no atomics).
  """
  flags = "--xla_gpu_deterministic_ops=true"
  digests = {_digest_in_fresh_process(impl, flags) for _ in range(3)}
  assert len(digests) == 1, digests


# ---- Transformations and training patterns. ----


def test_vmap_over_a_leading_batch_axis(rng, impl):
  """vmap works (its lax.cond becomes a select: every chunk is computed)."""
  problem = make_problem(rng, (3, 11), mask="scattered", bias=True)

  def per_sequence(hidden, weight, labels, bias, where):
    return mst_jax.linear_cross_entropy(
      hidden, weight, labels, bias, where=where, impl=impl, chunk_size=4
    )

  def total(hidden, weight, bias):
    losses = jax.vmap(per_sequence, in_axes=(0, None, 0, None, 0))(
      hidden, weight, problem.labels, bias, problem.where
    )
    return jnp.sum(losses)

  loss, grads = jax.value_and_grad(total, argnums=(0, 1, 2))(
    problem.hidden, problem.weight, problem.bias
  )
  with jax.enable_x64(True):
    args = [
      jnp.asarray(to64(x)) for x in (problem.hidden, problem.weight, problem.bias)
    ]

    def ref_total(hidden, weight, bias):
      return sum(
        oracle64.cross_entropy(
          hidden[i], weight, problem.labels[i], bias, where=problem.where[i]
        )
        for i in range(3)
      )

    ref, ref_grads = jax.value_and_grad(ref_total, argnums=(0, 1, 2))(*args)
  assert_close(loss, np.asarray(ref), LOSS_RTOL["float32"], "loss")
  for g, r in zip(grads, ref_grads, strict=True):
    assert_close(g, np.asarray(r), GRAD_RTOL["float32"], "grad")


def _model_loss(fn, params, tokens, labels, **kwargs):
  """A two-layer model around the head: embedding, tanh MLP, tied-free head."""
  embed, mix, head = params
  hidden = jnp.tanh(embed[tokens] @ mix)
  return fn(hidden, head, labels, **kwargs)


def _model_params(rng, vocab=257, dim=16):
  return tuple(
    jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)
    for shape, scale in (((vocab, dim), 1.0), ((dim, dim), 0.3), ((vocab, dim), 0.3))
  )


def _model_oracle(params, batches):
  """float64 gradient of the summed loss over micro-batches."""
  with jax.enable_x64(True):
    params64 = tuple(jnp.asarray(to64(p)) for p in params)

    def total(params):
      return sum(_model_loss(oracle64.cross_entropy, params, t, y) for t, y in batches)

    return jax.value_and_grad(total)(params64)


def test_checkpoint_around_a_larger_model(rng, impl):
  params = _model_params(rng)
  tokens = jnp.asarray(rng.integers(0, 257, (2, 9)), jnp.int32)
  labels = jnp.asarray(rng.integers(0, 257, (2, 9)), jnp.int32)
  remat_loss = jax.checkpoint(
    lambda p: _model_loss(mst_jax.linear_cross_entropy, p, tokens, labels, impl=impl)
  )
  loss, grads = jax.jit(jax.value_and_grad(remat_loss))(params)
  ref, ref_grads = _model_oracle(params, [(tokens, labels)])
  assert_close(loss, np.asarray(ref), LOSS_RTOL["float32"], "loss")
  for g, r in zip(grads, ref_grads, strict=True):
    assert_close(g, np.asarray(r), GRAD_RTOL["float32"], "grad")


def test_gradient_accumulation_with_scan(rng, impl):
  params = _model_params(rng)
  tokens = jnp.asarray(rng.integers(0, 257, (3, 2, 9)), jnp.int32)  # 3 micro-batches
  labels = jnp.asarray(rng.integers(0, 257, (3, 2, 9)), jnp.int32)
  step_grad = jax.value_and_grad(
    lambda p, t, y: _model_loss(mst_jax.linear_cross_entropy, p, t, y, impl=impl)
  )

  @jax.jit
  def accumulate(params):
    def body(carry, batch):
      loss, grads = step_grad(params, *batch)
      return jax.tree.map(jnp.add, carry, (loss, grads)), None

    zeros = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
    return jax.lax.scan(body, zeros, (tokens, labels))[0]

  loss, grads = accumulate(params)
  ref, ref_grads = _model_oracle(params, list(zip(tokens, labels, strict=True)))
  assert_close(loss, np.asarray(ref), LOSS_RTOL["float32"], "loss")
  for g, r in zip(grads, ref_grads, strict=True):
    assert_close(g, np.asarray(r), GRAD_RTOL["float32"], "grad")


def _scan_of_micro_batches(loss, **kwargs):
  """Gradient accumulation written as the gradient of a scan: the summed loss
  of micro-batches ``(hidden [K, T, D], labels [K, T])``."""

  def total(weight, hidden, labels):
    def body(carry, batch):
      return carry + loss(batch[0], weight, batch[1], **kwargs), None

    return jax.lax.scan(body, jnp.zeros(()), (hidden, labels))[0]

  return total


def _naive_head(hidden, weight, labels):
  logits = (hidden @ weight.T).astype(jnp.float32)
  target = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
  return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target)


def test_grad_of_a_scan_over_micro_batches(rng, impl):
  """Micro-batches of fewer rows than D: the default mode keeps one float
  per row per step, and the gradient matches the float64 oracle."""
  k, t, dim, vocab = 3, 10, 24, 203
  hidden = jnp.asarray(rng.standard_normal((k, t, dim)), jnp.float32)
  weight = jnp.asarray(rng.standard_normal((vocab, dim)) / 3, jnp.float32)
  labels = jnp.asarray(rng.integers(0, vocab, (k, t)), jnp.int32)
  total = _scan_of_micro_batches(mst_jax.linear_cross_entropy, impl=impl)
  loss, grads = jax.jit(jax.value_and_grad(total, argnums=(0, 1)))(
    weight, hidden, labels
  )
  with jax.enable_x64(True):
    reference = _scan_of_micro_batches(oracle64.cross_entropy)
    args64 = (jnp.asarray(to64(weight)), jnp.asarray(to64(hidden)), labels)
    ref, ref_grads = jax.value_and_grad(reference, argnums=(0, 1))(*args64)
  assert_close(loss, np.asarray(ref), LOSS_RTOL["float32"], "loss")
  for g, r in zip(grads, ref_grads, strict=True):
    assert_close(g, np.asarray(r), GRAD_RTOL["float32"], "grad")


def test_grad_of_a_scan_holds_less_than_the_naive_head():
  """Compile-only: 32 micro-batches of 64 tokens, D=512, V=16384. The fused
  mode would stack a [V, D] dweight per step (about 1 GiB here)."""
  k, t, dim, vocab = 32, 64, 512, 16384
  shapes = (
    jax.ShapeDtypeStruct((vocab, dim), jnp.float32),
    jax.ShapeDtypeStruct((k, t, dim), jnp.float32),
    jax.ShapeDtypeStruct((k, t), jnp.int32),
  )

  def temps(loss, **kwargs):
    grad = jax.grad(_scan_of_micro_batches(loss, **kwargs), argnums=(0, 1))
    compiled = jax.jit(grad).lower(*shapes).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  naive = temps(_naive_head)
  assert temps(mst_jax.linear_cross_entropy) <= 0.5 * naive
  assert temps(mst_jax.linear_cross_entropy, grad_mode="fused") > naive


def test_grad_of_a_scan_of_per_token_outputs_holds_no_more_than_the_naive_head():
  """Compile-only: 8 micro-batches of 512 tokens, D=128, V=8192, per-token
  log-probs. With at least D rows, each step keeps its logits for the
  backward (one ``[T, V]`` residual per step, as the naive head keeps its
  own); ``grad_mode="recompute"`` keeps one float per row."""
  k, t, dim, vocab = 8, 512, 128, 8192
  shapes = (
    jax.ShapeDtypeStruct((vocab, dim), jnp.float32),
    jax.ShapeDtypeStruct((k, t, dim), jnp.float32),
    jax.ShapeDtypeStruct((k, t), jnp.int32),
  )

  def naive(hidden, weight, labels):
    log_p = jax.nn.log_softmax((hidden @ weight.T).astype(jnp.float32), axis=-1)
    return jnp.sum(jnp.take_along_axis(log_p, labels[:, None], axis=-1))

  def kept(hidden, weight, labels, **kwargs):
    return jnp.sum(mst_jax.linear_log_probs(hidden, weight, labels, **kwargs))

  def temps(loss, **kwargs):
    grad = jax.grad(_scan_of_micro_batches(loss, **kwargs), argnums=(0, 1))
    compiled = jax.jit(grad).lower(*shapes).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  default, recompute = temps(kept), temps(kept, grad_mode="recompute")
  # Measured 1.04x the naive head's on XLA:CPU (float32): the same residuals,
  # and a little more working memory in one step's backward.
  assert recompute < default <= 1.1 * temps(naive), (recompute, default)
  assert default >= k * t * vocab * 4  # the residuals: every step's logits


def test_donated_train_step_and_no_recompilation(rng, impl):
  """A jitted SGD step with donated parameters, same shapes: traced once."""
  params = _model_params(rng)
  traces = []

  @jax.jit
  def sgd_step(params, tokens, labels):
    traces.append(1)
    loss, grads = jax.value_and_grad(
      lambda p: _model_loss(mst_jax.linear_cross_entropy, p, tokens, labels, impl=impl)
    )(params)
    return loss, jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)

  sgd_step = jax.jit(sgd_step.__wrapped__, donate_argnums=(0,))
  losses = []
  for _ in range(6):
    tokens = jnp.asarray(rng.integers(0, 257, (2, 9)), jnp.int32)
    loss, params = sgd_step(params, tokens, jnp.roll(tokens, -1, axis=1))
    losses.append(float(loss))
  assert len(traces) == 1, f"traced {len(traces)} times"
  assert np.isfinite(losses).all()


# ---- Property tests. ----


@settings(
  max_examples=12,
  deadline=None,
  derandomize=False,
  suppress_health_check=[HealthCheck.too_slow],
)
@given(
  data=st.data(),
  n_rows=st.integers(1, 40),
  dim=st.integers(1, 12),
  vocab=st.integers(2, 300),
  dtype=st.sampled_from(["float32", "bfloat16"]),
  reduction=st.sampled_from(["mean", "sum", "none"]),
)
def test_random_problems_match_the_oracle(data, n_rows, dim, vocab, dtype, reduction):
  seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
  rng = np.random.default_rng(seed)
  problem = make_problem(
    rng,
    (n_rows,),
    dim=dim,
    vocab=vocab,
    dtype=dtype,
    mask=data.draw(st.sampled_from(["none", "prefix", "scattered"]), label="mask"),
    bias=data.draw(st.booleans(), label="bias"),
  )
  options = dict(
    label_smoothing=data.draw(st.sampled_from([0.0, 0.05, 1.0]), label="smoothing"),
    z_loss=data.draw(st.sampled_from([0.0, 1e-3]), label="z_loss"),
    logit_softcap=data.draw(st.sampled_from([None, 2.0, 30.0]), label="softcap"),
  )
  chunk_size = data.draw(st.one_of(st.none(), st.integers(1, n_rows)), label="chunk")
  grad_mode = (
    "recompute"
    if reduction == "none"
    else data.draw(st.sampled_from(["fused", "recompute"]), label="grad_mode")
  )
  check_against_oracle(
    problem,
    dtype,
    impl="xla",
    chunk_size=chunk_size,
    reduction=reduction,
    grad_mode=grad_mode,
    **options,
  )


@pytest.mark.gpu
def test_repeated_train_steps_keep_peak_memory_flat():
  """200 jitted SGD steps: memory in use and its peak stop growing after warm-up."""
  rng = np.random.default_rng(0)
  device = jax.devices()[0]
  params = _model_params(rng, vocab=32000, dim=512)
  tokens = jnp.asarray(rng.integers(0, 32000, (8, 512)), jnp.int32)

  @jax.jit
  def step(params, tokens):
    loss, grads = jax.value_and_grad(
      lambda p: _model_loss(
        mst_jax.linear_cross_entropy, p, tokens, jnp.roll(tokens, -1, 1)
      )
    )(params)
    return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

  readings = {}
  for i in range(200):
    loss, params = step(params, tokens)
    if i in (9, 199):
      jax.block_until_ready(params)
      stats = device.memory_stats()
      readings[i] = (stats["bytes_in_use"], stats["peak_bytes_in_use"])
  assert np.isfinite(float(loss))
  assert readings[199] == readings[9], readings


@pytest.mark.parametrize(
  "impl, extra, grad_mode",
  [
    ("reference", {}, "fused"),
    ("xla", {}, "fused"),
    ("xla", {"vocab_block_size": 256, "chunk_size": 16}, "recompute"),
    ("pallas", {}, "fused"),  # the first 2048-column kernel block is all -inf
    ("pallas", {}, "recompute"),
    ("pallas", {"vocab_block_size": 256, "chunk_size": 16}, "fused"),
  ],
)
def test_banned_tokens_by_a_minus_inf_bias(rng, impl, extra, grad_mode):
  """A bias of -inf on the first 2100 of 4099 columns (whole vocabulary
  blocks and the first kernel block): the loss and gradients equal those of
  the head without those columns, finite, when every label is allowed."""
  problem = make_problem(rng, (2, 13), dim=8, vocab=4099, bias=True, mask="none")
  banned = 2100
  bias = problem.bias.at[:banned].set(-jnp.inf)
  labels = jnp.maximum(problem.labels, banned)
  if impl != "reference":
    extra = {**extra, "grad_mode": grad_mode}

  def run(weight, bias, labels):
    return jax.value_and_grad(mst_jax.linear_cross_entropy, argnums=(0, 1))(
      problem.hidden, weight, labels, bias, impl=impl, **extra
    )

  value, (dh, dw) = run(problem.weight, bias, labels)
  ref, (ref_dh, ref_dw) = run(
    problem.weight[banned:], problem.bias[banned:], labels - banned
  )
  assert _finite(value, dh, dw)
  assert_close(value, ref, 1e-5, "loss")
  assert_close(dh, ref_dh, 1e-4, "dhidden")
  assert_close(dw[banned:], ref_dw, 1e-4, "dweight")
  np.testing.assert_array_equal(np.asarray(dw[:banned]), 0.0)


@pytest.mark.gpu
def test_kernel_calls_over_2_31_logits():
  """One group of 16384 rows at V=256000 (4.2e9 logits, past int32 offsets)
  in one Pallas kernel call, by a memory budget larger than the default: the
  last rows' per-token losses and dhidden rows (each depends on its own row
  only) against the float64 reference of those rows."""
  n_rows, dim, vocab, last = 16384, 256, 256000, 64
  rng = np.random.default_rng(0)
  hidden = jnp.asarray(rng.standard_normal((n_rows, dim)), jnp.bfloat16)
  weight = jnp.asarray(rng.standard_normal((vocab, dim)) / 16, jnp.bfloat16)
  labels = jnp.asarray(rng.integers(0, vocab, n_rows), jnp.int32)
  g = jnp.asarray(rng.standard_normal(n_rows), jnp.float32)

  def total(fn, h, **kwargs):
    losses = fn(h, weight, labels, reduction="none", **kwargs)
    return jnp.sum(losses * g), losses

  step = jax.jit(
    jax.value_and_grad(
      lambda h: total(mst_jax.linear_cross_entropy, h, memory_budget=16 << 30),
      has_aux=True,
    )
  )
  (_, losses), dhidden = step(hidden)
  with jax.enable_x64(True):
    rows = slice(n_rows - last, n_rows)
    h64, w64 = (jnp.asarray(to64(x)) for x in (hidden[rows], weight))

    def ref_total(h):
      losses = oracle64.cross_entropy(h, w64, labels[rows], reduction="none")
      return jnp.sum(losses * g[rows]), losses

    (_, ref_losses), ref_dhidden = jax.value_and_grad(ref_total, has_aux=True)(h64)
  # bfloat16 logits (the default here) round each score by about 4e-3; an
  # offset that wrapped around would read other rows' logits entirely.
  assert_close(losses[rows], ref_losses, 1e-2, "loss", atol=1e-3)
  assert_close(dhidden[rows], ref_dhidden, 2e-2, "dhidden")
