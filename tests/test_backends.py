"""Each per-chunk backend against the float64 reference, kernel by kernel.

The oracle is ``reference.losses_from_logits`` run in float64, differentiated
by autodiff for ``dlogits``; the backends share only ``ce_math`` with each
other, not with it.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, has_gpu

from mst_jax import _kernels as backends
from mst_jax import reference
from mst_jax._gemm.mosaic import gemm as mosaic_gemm
from mst_jax._kernels.mosaic.ce import MosaicChunkCE
from mst_jax._kernels.triton import ce as triton_ce
from mst_jax._kernels.triton.ce import KernelBlocks, PallasTritonChunkCE
from mst_jax._math import ce as ce_math

ALL_OPTIONS = ce_math.CEOptions(label_smoothing=0.1, z_loss=1e-3, logit_softcap=30.0)
SCALED = ce_math.CEOptions(label_smoothing=0.1, logit_softcap=30.0, logit_scale=0.4)
PLAIN = ce_math.CEOptions()

CPU_BACKENDS = {
  "xla": backends.XlaChunkCE(),
  # Blocks smaller than V so that the vocabulary loop and its tail run.
  "pallas_interpret": PallasTritonChunkCE(
    blocks=KernelBlocks(block_rows=2, block_v=256, num_warps=4), interpret=True
  ),
  "pallas_interpret_default_blocks": PallasTritonChunkCE(interpret=True),
}


def _logits_case(rng, case, n_rows, vocab):
  """Float32 logits ``[n_rows, vocab]``, int32 labels and bool validity."""
  logits = rng.standard_normal((n_rows, vocab)) * 3.0
  labels = rng.integers(0, vocab, n_rows)
  valid = rng.random(n_rows) > 0.25
  tail = vocab - vocab % 256 if vocab % 256 else vocab - 256
  if case == "label_in_tail":
    labels[: n_rows // 2] = rng.integers(tail, vocab, n_rows // 2)
  elif case == "very_negative":
    logits[::2] = -1e4 + rng.standard_normal((len(logits[::2]), vocab))
  elif case == "large":
    logits = rng.standard_normal((n_rows, vocab)) * 1e4
  elif case == "all_excluded":
    valid[:] = False
  elif case != "normal":
    raise ValueError(case)
  labels[0] = vocab - 1  # always one label in the last (padded) block
  return (
    jnp.asarray(logits, jnp.float32),
    jnp.asarray(labels, jnp.int32),
    jnp.asarray(valid),
  )


def _oracle(logits, labels, valid, g_loss, g_lse, options):
  """float64 ``(loss, lse, correct)`` and ``dlogits`` for cotangents g."""
  with jax.enable_x64(True):
    logits64 = jnp.asarray(np.asarray(logits, np.float64))
    g_loss64, g_lse64 = (
      jnp.asarray(np.asarray(g, np.float64)) for g in (g_loss, g_lse)
    )

    def weighted(x):
      loss, lse, *_ = reference.losses_from_logits(x, labels, valid, options=options)
      return jnp.sum(g_loss64 * loss + g_lse64 * lse)

    outputs = reference.losses_from_logits(logits64, labels, valid, options=options)
    outputs = outputs[:3]  # (loss, lse, correct); no entropy asked for
    dlogits = jax.grad(weighted)(logits64)
    return [np.asarray(o) for o in outputs], np.asarray(dlogits)


def _label_tied_for_max(logits, labels, valid, options) -> np.ndarray:
  """Valid rows whose label's float32 score ties the row's maximum with
  another column's, to a few ulps, where the float64 scores differ (a softcap
  saturates large logits to ``c`` in float32): whether the label is "the"
  argmax there is rounding's choice, so ``correct`` may differ from the
  float64 oracle's. Logits that are equal stay checked."""
  s = np.asarray(ce_math.scores(jnp.asarray(logits, jnp.float32), options))
  top = s.max(axis=-1, keepdims=True)
  near = np.abs(s - top) <= 4 * np.spacing(np.abs(top))
  label = np.clip(np.asarray(labels), 0, s.shape[1] - 1)[:, None]
  at_top = np.take_along_axis(near, label, axis=1)[:, 0]
  z = np.asarray(logits, np.float64)
  near_z = np.where(near, z, np.nan)  # scores are monotone in the logits
  distinct = np.nanmax(near_z, axis=-1) > np.nanmin(near_z, axis=-1)
  return np.asarray(valid) & at_top & distinct


def check_backend(backend, logits, labels, valid, options, rng, out_dtype=jnp.float32):
  n_rows, vocab = logits.shape
  g_loss = jnp.asarray(rng.random(n_rows) + 0.5, jnp.float32)
  g_lse = jnp.asarray(rng.standard_normal(n_rows), jnp.float32)
  (ref_loss, ref_lse, ref_correct), ref_dlogits = _oracle(
    logits, labels, valid, g_loss, g_lse, options
  )
  # p = exp(s - lse) inherits lse's float32 rounding, ulp(|logits|): 1e-3 at 1e4.
  magnitude = float(np.max(np.abs(np.asarray(logits))))
  grad_rtol = max(1e-5, 4 * magnitude * 2.0**-24)
  if out_dtype != jnp.float32:
    grad_rtol = max(grad_rtol, 8e-3)

  stats = backend.forward(logits, labels, options)
  loss, lse, correct, _ = ce_math.row_outputs(stats, labels, valid, options, vocab)
  assert_close(loss, ref_loss, 1e-6, "loss")
  assert_close(lse, ref_lse, 1e-6, "lse")
  tied = _label_tied_for_max(logits, labels, valid, options)
  np.testing.assert_array_equal(np.asarray(correct)[~tied], ref_correct[~tied])
  if options.logit_softcap is None:  # a softcap saturates very large logits to ties
    np.testing.assert_array_equal(stats.argmax, np.argmax(np.asarray(logits), axis=-1))

  rows = ce_math.backward_rows(g_loss, g_lse, stats.lse, labels, valid, options, vocab)
  dlogits = backend.backward(logits, labels, rows, options, out_dtype)
  assert dlogits.dtype == out_dtype
  assert_close(dlogits, ref_dlogits, grad_rtol, "dlogits")
  np.testing.assert_array_equal(np.asarray(dlogits, np.float32)[~np.asarray(valid)], 0)

  (_, ref_fused_dlogits) = _oracle(
    logits, labels, valid, g_loss, jnp.zeros_like(g_lse), options
  )
  fused_stats, fused = backend.forward_backward(
    logits, labels, valid, g_loss, options, out_dtype
  )
  assert_close(fused_stats.lse, np.asarray(stats.lse, np.float64), 1e-6, "fused lse")
  np.testing.assert_array_equal(fused_stats.argmax, stats.argmax)
  assert_close(fused, ref_fused_dlogits, grad_rtol, "fused dlogits")


@pytest.mark.parametrize("backend", list(CPU_BACKENDS))
@pytest.mark.parametrize(
  "case", ["normal", "label_in_tail", "very_negative", "large", "all_excluded"]
)
@pytest.mark.parametrize(
  "options", [PLAIN, ALL_OPTIONS, SCALED], ids=["plain", "all", "scaled"]
)
def test_backend_matches_oracle(rng, backend, case, options):
  logits, labels, valid = _logits_case(rng, case, 9, 1031)
  check_backend(CPU_BACKENDS[backend], logits, labels, valid, options, rng)


@pytest.mark.parametrize("backend", list(CPU_BACKENDS))
@pytest.mark.parametrize("logits_dtype", [jnp.float32, jnp.bfloat16])
def test_backend_bfloat16_dlogits(rng, backend, logits_dtype):
  """bfloat16 dlogits; from bfloat16 logits, the fused kernel writes in place."""
  logits, labels, valid = _logits_case(rng, "normal", 5, 1031)
  logits = logits.astype(logits_dtype)  # the oracle reads these values exactly
  check_backend(
    CPU_BACKENDS[backend],
    logits,
    labels,
    valid,
    ALL_OPTIONS,
    rng,
    out_dtype=jnp.bfloat16,
  )


def test_vocab_smaller_than_one_block(rng):
  logits, labels, valid = _logits_case(rng, "normal", 3, 37)
  backend = PallasTritonChunkCE(
    blocks=KernelBlocks(block_rows=4, block_v=128, num_warps=4), interpret=True
  )
  check_backend(backend, logits, labels, valid, ALL_OPTIONS, rng)


def test_select_picks_backends():
  assert isinstance(backends.select(None, "cpu"), backends.XlaChunkCE)
  assert isinstance(backends.select("xla", "gpu"), backends.XlaChunkCE)
  pallas = backends.select("pallas", "cpu")
  assert isinstance(pallas, PallasTritonChunkCE) and pallas.interpret


def test_kernel_blocks_are_validated():
  with pytest.raises(ValueError, match="block_v must be a power of 2, got 1000"):
    KernelBlocks(block_v=1000)
  with pytest.raises(ValueError, match="num_stages"):
    KernelBlocks(num_stages=0)


# ---- On the GPU: compiled Triton kernels at unaligned and real sizes. ----


@pytest.mark.gpu
@pytest.mark.parametrize(
  "logits_dtype, out_dtype",
  [
    (jnp.float32, jnp.float32),
    (jnp.float32, jnp.bfloat16),
    (jnp.bfloat16, jnp.bfloat16),  # the fused kernel in place
  ],
  ids=["f32", "bf16", "bf16_logits"],
)
@pytest.mark.parametrize(
  "n_rows, vocab", [(37, 1031), (1000, 50257), (1024, 128256), (1024, 256000)]
)
def test_pallas_gpu_matches_oracle(rng, n_rows, vocab, logits_dtype, out_dtype):
  assert has_gpu()
  logits, labels, valid = _logits_case(rng, "normal", n_rows, vocab)
  logits = logits.astype(logits_dtype)
  check_backend(
    PallasTritonChunkCE(), logits, labels, valid, ALL_OPTIONS, rng, out_dtype=out_dtype
  )


# Each block_v the heuristic picks (its V in parentheses), then row blocks.
_GPU_BLOCKS = [
  *((vocab, None) for vocab in (100, 200, 300, 1000, 4099)),
  *(
    (vocab, KernelBlocks(block_rows=rows, block_v=block_v, num_warps=warps))
    for vocab in (1031, 50257)
    for rows, block_v, warps in ((1, 128, 4), (2, 512, 4), (4, 1024, 8), (8, 2048, 8))
  ),
]


@pytest.mark.gpu
@pytest.mark.parametrize(
  "vocab, blocks", _GPU_BLOCKS, ids=lambda x: str(x) if isinstance(x, int) else None
)
def test_pallas_gpu_ragged_vocabulary_for_each_block_shape(rng, vocab, blocks):
  """V never a multiple of block_v, label in the last (partial) block."""
  logits, labels, valid = _logits_case(rng, "label_in_tail", 37, vocab)
  backend = PallasTritonChunkCE(blocks=blocks)
  check_backend(backend, logits, labels, valid, ALL_OPTIONS, rng)
  check_backend(
    backend, logits.astype(jnp.bfloat16), labels, valid, PLAIN, rng, jnp.bfloat16
  )


@pytest.mark.gpu
def test_pallas_gpu_scaled_logits(rng):
  """logit_scale with a softcap, bfloat16 logits in place, the Llama-3 vocabulary."""
  logits, labels, valid = _logits_case(rng, "normal", 256, 128256)
  logits = logits.astype(jnp.bfloat16)
  check_backend(
    PallasTritonChunkCE(), logits, labels, valid, SCALED, rng, out_dtype=jnp.bfloat16
  )


@pytest.mark.gpu
@pytest.mark.parametrize(
  "case", ["label_in_tail", "very_negative", "large", "all_excluded"]
)
def test_pallas_gpu_edge_cases(rng, case):
  logits, labels, valid = _logits_case(rng, case, 67, 4099)
  check_backend(PallasTritonChunkCE(), logits, labels, valid, ALL_OPTIONS, rng)


@pytest.mark.gpu
def test_select_on_gpu():
  """impl=None: the Mosaic GPU kernels on a Hopper GPU (XLA's behind
  them), the Triton ones on other GPUs."""
  assert backends.pallas_unavailable_reason("gpu") is None
  chosen = backends.select(None, "gpu")
  if mosaic_gemm.unavailable_reason() is None:
    assert isinstance(chosen, MosaicChunkCE)
    assert isinstance(chosen.fallback(), backends.XlaChunkCE)
  else:
    assert isinstance(chosen, PallasTritonChunkCE)


def test_the_mosaic_kernels_never_ask_for_triton(monkeypatch):
  """The Mosaic kernels run what they do not take (float32 inputs, class
  weights) on XLA: neither selecting them nor their fallbacks compiles a
  Triton kernel (Pallas's Triton lowering is deprecated)."""
  asked = []
  monkeypatch.setattr(mosaic_gemm, "unavailable_reason", lambda: None)
  monkeypatch.setattr(
    backends, "pallas_unavailable_reason", lambda platform: asked.append(platform)
  )
  chosen = backends.select(None, "gpu")
  distill = backends.select_distill(None, "gpu")
  assert isinstance(chosen, MosaicChunkCE)
  assert isinstance(chosen.fallback(), backends.XlaChunkCE)
  assert isinstance(distill.fallback(), backends.XlaDistill)
  assert asked == []


def test_unavailable_triton_falls_back_to_xla_with_one_warning(monkeypatch):
  from mst_jax._kernels.triton import ce as triton_ce

  def broken():
    raise NotImplementedError("no Triton lowering in this jax")

  monkeypatch.setattr(triton_ce, "smoke_test", broken)
  monkeypatch.setattr(mosaic_gemm, "unavailable_reason", lambda: "not a Hopper GPU")
  backends.pallas_unavailable_reason.cache_clear()
  backends._warn_fallback.cache_clear()
  try:
    with pytest.warns(
      RuntimeWarning, match="XLA per-chunk backend.*no Triton lowering"
    ):
      assert isinstance(backends.select("pallas", "gpu"), backends.XlaChunkCE)
      assert isinstance(backends.select(None, "gpu"), backends.XlaChunkCE)
    with warnings.catch_warnings():
      warnings.simplefilter("error")  # a second selection warns no more
      assert isinstance(backends.select("pallas", "gpu"), backends.XlaChunkCE)
  finally:
    backends.pallas_unavailable_reason.cache_clear()
    backends._warn_fallback.cache_clear()


def _run_fresh_process(code: str, warning_filter: str) -> str:
  """Runs ``code`` in a new Python process under ``-W warning_filter``;
  returns its stderr (the test fails if the process does)."""
  command = [sys.executable, "-W", warning_filter, "-c", code]
  result = subprocess.run(command, capture_output=True, text=True)
  assert result.returncode == 0, result.stderr
  return result.stderr


@pytest.mark.gpu
def test_a_step_the_mosaic_kernels_run_whole_warns_nothing():
  """A fresh process's default steps (cross-entropy and distillation) on a
  Hopper GPU: no deprecation warning at all (no Triton kernel runs; the
  planner's probe of one keeps quiet), also where the Mosaic kernels do not
  take the inputs: float32, and distillation with ``[D, V]`` weights at
  GPT-2's vocabulary, which the planner first sees untransposed."""
  if mosaic_gemm.unavailable_reason() is not None:
    pytest.skip("needs the Mosaic GPU kernels (a Hopper GPU)")
  code = (
    "import jax, jax.numpy as jnp, mst_jax\n"
    "h = jnp.ones((256, 128), jnp.bfloat16); w = jnp.ones((1024, 128), jnp.bfloat16)\n"
    "y = jnp.zeros((256,), jnp.int32)\n"
    "jax.grad(mst_jax.linear_cross_entropy)(h, w, y).block_until_ready()\n"
    "jax.grad(mst_jax.linear_distillation_loss)(h, w, h, w).block_until_ready()\n"
    "wd = jnp.ones((128, 50257), jnp.bfloat16)\n"
    "distill = mst_jax.linear_distillation_loss\n"
    "loss = lambda h, w: distill(h, w, h, w, weight_layout='dv')\n"
    "jax.grad(loss)(h, wd).block_until_ready()\n"
    "h, w = h.astype(jnp.float32), w.astype(jnp.float32)\n"
    "jax.grad(mst_jax.linear_cross_entropy)(h, w, y).block_until_ready()\n"
    "jax.grad(mst_jax.linear_distillation_loss)(h, w, h, w).block_until_ready()\n"
  )
  stderr = _run_fresh_process(code, "error::DeprecationWarning")
  assert "Warning" not in stderr, stderr


@pytest.mark.gpu
def test_triton_deprecation_warning_shows_once_per_process():
  """Two different jitted losses in a fresh process: at most one warning."""
  code = (
    "import jax, jax.numpy as jnp, mst_jax\n"
    "h = jnp.ones((64, 32), jnp.bfloat16); w = jnp.ones((1000, 32), jnp.bfloat16)\n"
    "y = jnp.zeros((64,), jnp.int32)\n"
    "for n in (64, 48):\n"
    "  jax.grad(mst_jax.linear_cross_entropy)(h[:n], w, y[:n]).block_until_ready()\n"
  )
  stderr = _run_fresh_process(code, "always::DeprecationWarning")
  assert stderr.count("Pallas Triton backend is deprecated") <= 1, stderr


def test_the_triton_probe_keeps_quiet(monkeypatch):
  """``smoke_test`` (which the Mosaic kernels' planning may call about a
  fallback the step never uses) hides Pallas's Triton deprecation warning
  raised while it lowers, and no other warning; here on a CPU, with a
  kernel that warns as jax 0.11's lowering does."""

  def forward(self, logits, labels, options, message):
    warnings.warn(message, DeprecationWarning, stacklevel=2)
    return logits.sum()

  for message, hidden in (
    ("The Pallas Triton backend is deprecated and will be removed.", True),
    ("something else is deprecated", False),
  ):
    patched = functools.partialmethod(forward, message=message)
    monkeypatch.setattr(triton_ce.PallasTritonChunkCE, "forward", patched)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      triton_ce.smoke_test()
    assert (not caught) == hidden, [str(w.message) for w in caught]
