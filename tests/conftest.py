"""Shared test helpers: random problems, the float64 oracle, tolerances."""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import itertools
import os

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import oracle as oracle64
import pytest
from jax import lax

import mst_jax
from mst_jax import _kernels, _plan
from mst_jax._gemm.mosaic import gemm as mosaic_gemm
from mst_jax._gemm.mosaic.config import accumulator_limit
from mst_jax._kernels.mosaic import ce as mosaic_ce
from mst_jax._kernels.mosaic import distill as mosaic_distill
from mst_jax._kernels.xla import XlaChunkCE
from mst_jax._losses import cross_entropy as _cross_entropy
from mst_jax._sweep import distill as _distill_sweep


def _cuda_plugin() -> bool:
  names = (d.metadata["Name"] or "" for d in importlib.metadata.distributions())
  return any(n.lower().replace("_", "-").startswith("jax-cuda") for n in names)


# The suite compiles thousands of small programs, and on the CPU LLVM's
# optimization took most of that time: at -O0 they compile about 40% faster,
# and the whole suite ran about a sixth faster on 2 cores. The programs' HLO,
# buffers and memory are XLA's and the same at any level; results agree to
# the tolerances below. Set before the backend starts (has_gpu below); the
# 8-device child inherits it. A level given in XLA_FLAGS is kept.
if not _cuda_plugin() and "xla_backend_optimization_level" not in os.environ.get(
  "XLA_FLAGS", ""
):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
  ).strip()


def has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


# Relative error ||out - ref|| / ||ref|| allowed against the float64 oracle,
# keyed by input dtype. Logits accumulate in float32 from exact products, so
# with float32 logits the loss is float32-accurate for every input dtype;
# gradients pass through dlogits and a matmul output in the input dtype.
# bfloat16 logits (the default for bfloat16 inputs) add their rounding, which
# check_against_oracle bounds from the float64 logits (_logits_rounding) for
# the loss, and measures for the gradients: they are held to the naive bfloat16
# head's error on the same problem (check_grads_against_naive), not to these.
CPU_LOSS_RTOL = {"float32": 2e-6, "bfloat16": 2e-6, "float16": 2e-6, "float64": 1e-12}
CPU_GRAD_RTOL = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3, "float64": 1e-12}
# On a GPU, float32 matmuls may run in TF32 (10-bit mantissa) and reductions
# sum in another order.
GPU_LOSS_RTOL = {**CPU_LOSS_RTOL, "float32": 2e-4, "bfloat16": 2e-5, "float16": 2e-5}
GPU_GRAD_RTOL = {**CPU_GRAD_RTOL, "float32": 3e-3, "float64": 1e-10}
ON_GPU = has_gpu()
LOSS_RTOL = GPU_LOSS_RTOL if ON_GPU else CPU_LOSS_RTOL
GRAD_RTOL = GPU_GRAD_RTOL if ON_GPU else CPU_GRAD_RTOL

# Fresh seeds each run; MST_TEST_SEED_START fixes the first (to sweep seeds).
_SEEDS = itertools.count(
  int(
    os.environ.get("MST_TEST_SEED_START") or np.random.SeedSequence().entropy % (2**31)
  )
)


# tests/multidevice needs 8 devices; test_multidevice.py runs it in a child.
collect_ignore = ["multidevice"] if jax.device_count() < 8 else []


# Single tests long enough to go with the slow part (see _mark_slow).
SLOW_TESTS = {
  "test_random_problems_match_the_oracle",  # hypothesis, many compilations
  "test_distill_tiny_lm_compares_the_students",
  "test_long_context_compares_the_heads_speed",
  "test_multi_device_layouts_match_one_device",  # the 8-device suite's layouts
  "test_multi_process_matches_one_process",
  "test_bitwise_deterministic_on_cpu",  # fresh processes
  "test_check_grads_float64",  # second order, numerically
  "test_second_derivatives_on_a_vocab_sharded_mesh",
  "test_llama_head_temporaries_within_budget",  # compiles Llama-3-sized heads
  "test_tiled_loss_matches_the_oracle",
}


def _lowers_the_hopper_program(item) -> bool:
  """A test that plans for a Hopper GPU to lower a step for CUDA on a host
  without one (5-14 s each on 2 cores): the slow part. The Mosaic GEMM's own
  lowering tests (well under a second) keep the quick run's CUDA check."""
  fixtures = getattr(item, "fixturenames", ())
  return "as_if_on_hopper" in fixtures and "mosaic_on_cpu" not in fixtures


def _mark_slow(items) -> None:
  """Splits the suite into a quick default run and a ``slow`` rest.

  Of each parametrized test the quick run keeps its first parametrization
  (in collection order); in a module that sets ``EVERY_VALUE_QUICKLY`` (the
  public functions' own tests) it keeps the first parametrizations that
  together take every value of every parameter. The rest of each grid is
  marked ``slow``, as are ``SLOW_TESTS`` and the tests that lower the Hopper
  program for CUDA; a test that runs the Mosaic GPU kernels in interpret mode
  (``mosaic_on_cpu``: 5-17 s each) keeps only its first parametrization. So
  ``pytest`` (``-m "not slow"``, the default) runs every test and every
  option of the public functions, and ``pytest -m slow`` runs everything
  else: CI runs both.
  """
  seen: dict = {}
  for item in items:
    name = getattr(item, "originalname", item.name)
    callspec = getattr(item, "callspec", None)
    if name in SLOW_TESTS or _lowers_the_hopper_program(item):
      item.add_marker(pytest.mark.slow)
    if callspec is None:
      continue
    test = (item.module.__name__, name)
    first = test not in seen
    covered = seen.setdefault(test, set())
    values = {(key, repr(value)) for key, value in callspec.params.items()}
    interpreted = "mosaic_on_cpu" in getattr(item, "fixturenames", ())
    every_value = getattr(item.module, "EVERY_VALUE_QUICKLY", False) and not interpreted
    if not first and (values <= covered or not every_value):
      item.add_marker(pytest.mark.slow)
    covered |= values


# Started first: xdist hands tests to its workers in collection order, and
# the longest one (a minute on 2 cores) started last would leave a worker idle.
FIRST_TESTS = {"test_multidevice_suite_on_8_cpu_devices"}


def pytest_collection_modifyitems(config, items):
  _mark_slow(items)
  items.sort(
    key=lambda item: getattr(item, "originalname", item.name) not in FIRST_TESTS
  )
  if ON_GPU:
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


# The shared suite's axes: every chunked implementation (on a CPU the Pallas
# kernels run in interpret mode), both gradient modes, and both loop orders
# (as the keyword arguments that select them; 1031-column problems get four
# 256-column blocks and a 7-column remainder).
IMPLS = ["xla", "pallas"]
GRAD_MODES = ["fused", "recompute"]
LOOP_ORDERS = {"row_chunks": {}, "vocab_blocks": {"vocab_block_size": 256}}
ALL_OPTIONS = dict(label_smoothing=0.1, z_loss=1e-3, logit_softcap=4.0)


@pytest.fixture(params=IMPLS)
def impl(request):
  return request.param


@pytest.fixture(params=GRAD_MODES)
def grad_mode(request):
  return request.param


@pytest.fixture(params=list(LOOP_ORDERS))
def loop_order(request):
  """Extra keyword arguments of ``linear_cross_entropy`` selecting a loop order."""
  return LOOP_ORDERS[request.param]


@pytest.fixture
def as_if_on_hopper(monkeypatch):
  """Plans for a Hopper GPU on any host, for lowering to CUDA: what CI
  without a GPU can check of the GPU program (the Mosaic and Triton kernels'
  Python lowering). The program is jaxlib 0.11's whatever jaxlib runs the
  test (tests/test_jax_versions.py checks what jaxlib 0.12 changes: the
  tiles and the statistics' kernel). Clears JAX's caches after, so no other
  test meets a program traced under these patches."""
  monkeypatch.setattr(mosaic_gemm, "unavailable_reason", lambda: None)
  monkeypatch.setattr(mosaic_gemm, "fuses_row_epilogues", lambda: True)
  limit = accumulator_limit("0.11.2")
  monkeypatch.setattr(mosaic_gemm, "_accumulator", lambda: limit)
  monkeypatch.setattr(_kernels, "pallas_unavailable_reason", lambda platform: None)
  monkeypatch.setattr(_cross_entropy, "_platform", lambda layout: "gpu")
  yield
  jax.clear_caches()


@pytest.fixture
def mosaic_on_cpu(as_if_on_hopper, monkeypatch):
  """The Hopper program run on a CPU: the GEMM as ``xla_gemm`` (it records
  each product's output width), the cross-entropy and distillation kernels
  in interpret mode, XLA's chunk behind them."""
  widths = []

  def gemm(lhs, rhs, dims, out_dtype=None, **kwargs):
    out = xla_gemm(lhs, rhs, dims, out_dtype, **kwargs)
    widths.append((out[0] if isinstance(out, tuple) else out).shape[1])
    return out

  monkeypatch.setattr(mosaic_gemm, "matmul", gemm)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # distillation's
  backend = mosaic_ce.MosaicChunkCE(fallback=XlaChunkCE, interpret=True)
  monkeypatch.setattr(_kernels, "select", lambda *args, **kwargs: backend)
  kernel = mosaic_distill.MosaicDistill(interpret=True)
  monkeypatch.setattr(_distill_sweep, "select_distill", lambda *args: kernel)
  yield widths


def xla_gemm(
  lhs,
  rhs,
  dimension_numbers,
  out_dtype=None,
  *,
  accumulate=None,
  config=None,
  row_epilogue=None,
  row_inputs=(),
  out_shape=None,
  zero_extend=False,
  bound=None,
  bounded=None,
):
  """``_gemm.mosaic.gemm.matmul``'s contract as an XLA product: float32
  accumulation rounded once, operands zero-extended, the output trimmed or
  zero-padded to ``out_shape``, ``accumulate`` added; a ``row_epilogue`` run
  over each ``config.tile_n`` columns of the rounded output, as stored.
  ``bounded="m"``: the output's rows (and the epilogue's) from the first
  multiple of 64 at or past ``bound`` are NaN (unspecified); ``"k"``: the
  contracted rows from there on are never read (NaN there leaves no trace)."""
  if bounded is not None:
    (lc,), (rc,) = dimension_numbers[0]
    cut = -(-bound // 64) * 64
    if bounded == "k":
      lhs, rhs = (_zero_from(x, cut, axis) for x, axis in ((lhs, lc), (rhs, rc)))
    out = xla_gemm(
      lhs,
      rhs,
      dimension_numbers,
      out_dtype,
      accumulate=accumulate,
      config=config,
      row_epilogue=row_epilogue,
      row_inputs=row_inputs,
      out_shape=out_shape,
      zero_extend=zero_extend,
    )
    if bounded == "k":
      return out
    nan_from = lambda x, axis: jnp.where(
      lax.broadcasted_iota(jnp.int32, x.shape, axis) < cut, x, jnp.nan
    ).astype(x.dtype)
    if row_epilogue is None:
      return nan_from(out, 0)
    out, parts = out
    return nan_from(out, 0), [nan_from(x, 1) for x in parts]
  if row_epilogue is not None:
    out = xla_gemm(lhs, rhs, dimension_numbers, out_dtype, out_shape=out_shape)
    width = config.tile_n
    tiles = jnp.pad(out, [(0, 0), (0, -out.shape[1] % width)])
    tiles = tiles.reshape(out.shape[0], -1, width)
    starts = jnp.arange(tiles.shape[1], dtype=jnp.int32) * width
    each = jax.vmap(lambda t, c: row_epilogue(t, c, list(row_inputs)), (1, 0))
    return out, list(each(tiles, starts))
  (lc,), (rc,) = dimension_numbers[0]
  assert zero_extend or lhs.shape[lc] == rhs.shape[rc]
  k = min(lhs.shape[lc], rhs.shape[rc])
  lhs, rhs = lax.slice_in_dim(lhs, 0, k, axis=lc), lax.slice_in_dim(rhs, 0, k, axis=rc)
  out = lax.dot_general(lhs, rhs, dimension_numbers, preferred_element_type=jnp.float32)
  if out_shape is not None:
    out = out[: out_shape[0], : out_shape[1]]
    out = jnp.pad(out, [(0, m - n) for m, n in zip(out_shape, out.shape, strict=True)])
  if accumulate is not None:
    out = out + accumulate.astype(jnp.float32)
  return out.astype(
    out_dtype or (lhs.dtype if accumulate is None else accumulate.dtype)
  )


def _zero_from(x, row, axis):
  """``x`` with its entries from ``row`` on along ``axis`` zeroed."""
  keep = lax.broadcasted_iota(jnp.int32, x.shape, axis) < row
  return jnp.where(keep, x, jnp.zeros_like(x))


@pytest.fixture
def appended(monkeypatch):
  """Appends 5 rows wherever the Mosaic GPU kernels' rule is asked
  (``_plan.tma_row_padding``; it asks for none on a CPU), so CPU tests
  exercise the appended rows; yields the row counts it was asked about."""
  asked = []

  def always(n_rows, block_rows, gemm, dtype):
    asked.append(n_rows)
    return 5

  monkeypatch.setattr(_plan, "tma_row_padding", always)
  jax.clear_caches()  # no program traced without the patch is reused
  yield asked
  jax.clear_caches()


@pytest.fixture
def planned(monkeypatch):
  """``(weight layout, memory budget)`` of each loop order that
  cross-entropy's ``resolve`` plans, in order."""
  from mst_jax._losses import cross_entropy

  plans, loop_order = [], cross_entropy._loop_order

  def recording(rows, perf, *args, **kwargs):
    layout = "vd" if rows.weight.shape[0] == rows.vocab_size else "dv"
    plans.append((layout, perf.memory_budget))
    return loop_order(rows, perf, *args, **kwargs)

  monkeypatch.setattr(cross_entropy, "_loop_order", recording)
  return plans


@pytest.fixture
def rng():
  """A fresh numpy Generator per test; the seed is printed on failure."""
  seed = next(_SEEDS)
  print(f"numpy seed: {seed}")
  return np.random.default_rng(seed)


@dataclasses.dataclass
class Problem:
  hidden: jax.Array
  weight: jax.Array
  labels: jax.Array
  bias: jax.Array | None
  where: jax.Array | None

  @property
  def args(self):
    return self.hidden, self.weight, self.labels, self.bias


def make_problem(
  rng,
  batch_shape=(37,),
  dim=24,
  vocab=1031,
  dtype="float32",
  *,
  mask="scattered",
  bias=False,
  weight_layout="vd",
  ignore_index=-100,
  logit_scale=3.0,
) -> Problem:
  """A random problem whose logits have standard deviation ~``logit_scale``.

  ``mask``: "none" (every token counts), "prefix" (the first ~half of each
  sequence is ``ignore_index``), "scattered" (``where`` drops ~40% at random)
  or "all" (every token excluded).
  """
  hidden = rng.standard_normal((*batch_shape, dim))
  weight = rng.standard_normal((vocab, dim)) * logit_scale / np.sqrt(dim)
  if weight_layout == "dv":
    weight = weight.T
  labels = rng.integers(0, vocab, batch_shape)
  where = None
  if mask == "prefix":
    seq = batch_shape[-1]
    cut = rng.integers(seq // 3, 2 * seq // 3 + 1, batch_shape[:-1] or (1,))
    prefix = np.arange(seq) < cut.reshape(-1, 1)
    labels = np.where(prefix.reshape(batch_shape), ignore_index, labels)
  elif mask == "scattered":
    where = rng.random(batch_shape) > 0.4
  elif mask == "all":
    where = np.zeros(batch_shape, bool)
  elif mask != "none":
    raise ValueError(mask)
  b = rng.standard_normal(vocab) * 0.5 if bias else None
  cast = lambda x: None if x is None else jnp.asarray(x, dtype)
  return Problem(
    hidden=cast(hidden),
    weight=cast(weight),
    labels=jnp.asarray(labels, jnp.int32),
    bias=cast(b),
    where=None if where is None else jnp.asarray(where),
  )


def _diff_argnums(problem):
  return (0, 1, 3) if problem.bias is not None else (0, 1)


def value_and_grads(fn, problem, **kwargs):
  """Loss and gradients (hidden, weight[, bias]) of ``fn`` on ``problem``."""

  def loss(hidden, weight, labels, bias):
    out = fn(hidden, weight, labels, bias, where=problem.where, **kwargs)
    return jnp.sum(out) if kwargs.get("reduction") == "none" else out

  return jax.value_and_grad(loss, argnums=_diff_argnums(problem))(*problem.args)


def to64(x):
  return None if x is None else np.asarray(jnp.asarray(x, jnp.float32), np.float64)


# Options of the chunked paths that the oracle does not take.
PERF_ONLY = (
  *(f.name for f in dataclasses.fields(mst_jax.PerfOptions)),
  "mesh",
  "batch_axis",
  "vocab_axis",
)


def oracle_options(kwargs) -> dict:
  """``linear_cross_entropy``'s keyword arguments that ``oracle64.cross_entropy``
  takes: all but the performance options and the mesh."""
  return {k: v for k, v in kwargs.items() if k not in PERF_ONLY}


def _compiled_value_and_grads(fn, problem, kwargs):
  """``value_and_grads(fn, problem, **kwargs)`` as one compiled program, under
  float64: the oracle's operations one by one take seconds for each new
  shape, a program well under one. Programs are kept per function and static
  options; arrays among ``kwargs`` (weights) are its arguments."""
  with jax.enable_x64(True):
    arrays, static = oracle64.arrays_and_static(kwargs)
    program = _value_and_grads_program(fn, static)
    return program(
      problem.hidden,
      problem.weight,
      problem.labels,
      problem.bias,
      problem.where,
      arrays,
    )


@functools.cache
def _value_and_grads_program(fn, static):
  def run(hidden, weight, labels, bias, where, arrays):
    problem = Problem(hidden, weight, labels, bias, where)
    return value_and_grads(fn, problem, **dict(static), **arrays)

  return jax.jit(run)


def oracle(problem, **kwargs):
  """Loss and gradients (hidden, weight[, bias]) from tests/oracle.py in float64."""
  with jax.enable_x64(True):
    p64 = dataclasses.replace(
      problem,
      hidden=jnp.asarray(to64(problem.hidden)),
      weight=jnp.asarray(to64(problem.weight)),
      bias=None if problem.bias is None else jnp.asarray(to64(problem.bias)),
    )
    loss, grads = _compiled_value_and_grads(
      oracle64.cross_entropy, p64, oracle_options(kwargs)
    )
    return np.asarray(loss), [np.asarray(g) for g in grads]


def lse64(problem, *, logit_softcap=None, logit_scale=None, **unused_options):
  """float64 per-token lse of the scaled, softcapped logits (0 at tokens that
  ``where`` or the label -100 exclude), from numpy."""
  logits = to64(problem.hidden) @ to64(problem.weight).T
  if problem.bias is not None:
    logits = logits + to64(problem.bias)
  logits = logits * (logit_scale or 1.0)
  if logit_softcap is not None:
    logits = logit_softcap * np.tanh(logits / logit_softcap)
  top = logits.max(axis=-1, keepdims=True)
  lse = (top + np.log(np.exp(logits - top).sum(axis=-1, keepdims=True)))[..., 0]
  where = True if problem.where is None else np.asarray(problem.where)
  return np.where(where & (np.asarray(problem.labels) != -100), lse, 0.0)


def bf16_logits(problem, kwargs) -> bool:
  """Whether ``linear_cross_entropy(**kwargs)`` rounds its logits to bfloat16."""
  if kwargs.get("impl") == "reference":
    return False
  dtype = kwargs.get("logits_dtype") or problem.hidden.dtype
  return np.dtype(dtype) == np.dtype(jnp.bfloat16)


def _naive_logits_dtype(problem, kwargs):
  """The logits dtype of the naive head the library is measured against, or
  None where the dtype-keyed tolerances apply: bfloat16 for bfloat16 inputs
  (a bfloat16 ``Dense`` head's), else the library's ``logits_dtype`` where
  that is bfloat16."""
  bf16 = np.dtype(jnp.bfloat16)
  compute = np.promote_types(problem.hidden.dtype, problem.weight.dtype)
  if compute == bf16:
    return bf16
  if bf16 in (problem.hidden.dtype, problem.weight.dtype) or bf16_logits(
    problem, kwargs
  ):
    return np.dtype(kwargs.get("logits_dtype") or compute)
  return None


def naive_head(problem, rounded_to=jnp.bfloat16, **kwargs):
  """Loss and gradients of the naive head (``_naive_cross_entropy``), float64
  arrays."""
  options = dict(oracle_options(kwargs), rounded_to=np.dtype(rounded_to))
  value, grads = _compiled_value_and_grads(_naive_cross_entropy, problem, options)
  return np.asarray(value), [to64(g) for g in grads]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def rounded(x, dtype):
  """``x.astype(dtype)``, its cotangent rounded to ``dtype`` too, each
  rounding pinned by ``lax.reduce_precision``: XLA:GPU may drop a
  convert pair such as float64 -> bfloat16 -> float32
  (``--xla_allow_excess_precision``, on by default), and did at some shapes
  (GPT-2's vocabulary, a bias), which left a naive head's ``dlogits``
  unrounded and its ``dhidden`` 1.6x more exact than bfloat16 ``dlogits``
  allow."""
  return _rounded_fwd(x, dtype)[0]


def _pin(x, dtype):
  info = jnp.finfo(dtype)
  return lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def _rounded_fwd(x, dtype):
  return _pin(x, dtype).astype(dtype), jnp.zeros((), x.dtype)


def _rounded_bwd(dtype, like, g):
  return (_pin(g.astype(like.dtype), dtype),)


rounded.defvjp(_rounded_fwd, _rounded_bwd)


def _naive_cross_entropy(
  hidden, weight, labels, bias, *, rounded_to, weight_layout="vd", **options
):
  """The loss of a naive head's logits: ``hidden @ weight.T`` in the inputs'
  (promoted) dtype, accumulated in float32, plus the bias, rounded to
  ``rounded_to``; their loss is the oracle's (in float64, whose difference
  from float32 math is far below a bfloat16 rounding). Autodiff rounds
  ``dlogits`` to ``rounded_to`` and each gradient to its input's dtype, as a
  model's own head does."""
  dtype = jnp.promote_types(hidden.dtype, weight.dtype)
  contract = 1 if weight_layout == "vd" else 0
  dims = (((hidden.ndim - 1,), (contract,)), ((), ()))
  logits = lax.dot_general(
    hidden.astype(dtype), weight.astype(dtype), dims, preferred_element_type=jnp.float32
  )
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  logits = rounded(logits, rounded_to)
  return oracle64.cross_entropy_of_logits(logits, labels, **options)


# The library's gradient error against the oracle is at most this multiple
# of the naive head's on the same inputs (plus NAIVE_FLOOR x |gradient|).
# They round the same logits, dlogits and outputs, so dhidden's errors are
# alike (within 1% of each other) and a term dropped from the gradient adds
# its own (0.4% of the gradient: 1.4x the error or more); dweight is summed
# over row chunks or vocabulary blocks in another order and rounding (up to
# 1.5x the naive error with vocab_block_size).
NAIVE_FACTOR = {"dhidden": 1.25, "dweight": 2.0, "dbias": 1.5}
NAIVE_FLOOR = 2.0**-14


def check_grads_against_naive(problem, grads, ref_grads, factor=NAIVE_FACTOR, **kwargs):
  """Each of ``grads`` within ``factor`` x the naive head's error (see
  ``_naive_logits_dtype``) of ``ref_grads``, the float64 oracle's.

  ``factor``: one per gradient name (``"dhidden"``, ``"dweight"``,
  ``"dbias"``), larger where a test has the library round one on purpose
  more often than the naive head (a ``dweight`` accumulated in bfloat16).
  """
  rounded_to = _naive_logits_dtype(problem, kwargs) or problem.hidden.dtype
  _, naive_grads = naive_head(problem, rounded_to, **kwargs)
  names = ("dhidden", "dweight", "dbias")
  for name, g, ref, naive in zip(names, grads, ref_grads, naive_grads, strict=False):
    naive_err = np.linalg.norm((naive - ref).ravel())
    allowed = factor[name]
    floor = NAIVE_FLOOR * np.linalg.norm(np.ravel(ref)) + 1e-30
    what = f"{name} (naive head's error {naive_err:.3g}, x{allowed})"
    assert_close(g, ref, 0.0, what, atol=allowed * naive_err + floor)


@dataclasses.dataclass
class Rows64:
  """A problem as float64 rows, for the rounding bounds.

  Attributes:
    hidden: ``[N, D]``.
    weight: ``[V, D]`` whatever the layout.
    labels: ``[N]``, the label each position is scored with (with ``shift``,
      the next position's).
    valid: bool ``[N]``, whether the position counts.
  """

  hidden: np.ndarray
  weight: np.ndarray
  labels: np.ndarray
  valid: np.ndarray


def _rows64(problem, options) -> Rows64:
  hidden, weight = to64(problem.hidden), to64(problem.weight)
  if options.get("weight_layout", "vd") == "dv":
    weight = weight.T
  labels = np.asarray(problem.labels).astype(np.int64)
  valid = labels != options.get("ignore_index", -100)
  if problem.where is not None:
    valid &= np.asarray(problem.where)
  if options.get("shift", False):
    labels = np.concatenate([labels[..., 1:], 0 * labels[..., :1]], axis=-1)
    valid = np.concatenate([valid[..., 1:], False & valid[..., :1]], axis=-1)
  dim = hidden.shape[-1]
  return Rows64(hidden.reshape(-1, dim), weight, labels.reshape(-1), valid.reshape(-1))


@functools.cache
def _dlogits_program(static):
  def total(logits, labels, where, arrays):
    out = oracle64.cross_entropy_of_logits(
      logits, labels, where=where, **dict(static), **arrays
    )
    return jnp.sum(out)

  return jax.jit(jax.grad(total))


def reference_dlogits(problem, **kwargs):
  """float64 ``d loss / d logits`` ``[N, V]`` from the oracle, and the rows.

  Also returns the float64 raw logits, the softmax of the scaled and
  softcapped ones and their lse per row.
  """
  options = oracle_options(kwargs)
  rows = _rows64(problem, options)
  options.pop("weight_layout", None)
  logits = rows.hidden @ rows.weight.T
  if problem.bias is not None:
    logits = logits + to64(problem.bias)
  logits_shape = (*problem.labels.shape, logits.shape[-1])
  with jax.enable_x64(True):
    arrays, static = oracle64.arrays_and_static(options)
    dlogits = _dlogits_program(static)(
      jnp.asarray(logits.reshape(logits_shape)), problem.labels, problem.where, arrays
    )
    dlogits = np.asarray(dlogits).reshape(logits.shape)
  scores = logits * (options.get("logit_scale") or 1.0)
  cap = options.get("logit_softcap")
  if cap is not None:
    scores = cap * np.tanh(scores / cap)
  top = scores.max(axis=1, keepdims=True)
  lse = (top + np.log(np.exp(scores - top).sum(axis=1, keepdims=True)))[:, 0]
  probs = np.exp(scores - lse[:, None])
  return dlogits, rows, logits, probs, lse


# Rounding a logit to bfloat16 moves it by at most this fraction of itself.
_BF16_HALF_ULP = 2.0**-8


def _logits_rounding(problem, kwargs):
  """``(loss_bound, row_shift)`` of rounding the logits to bfloat16.

  Rounding moves each logit by at most ``u |z|`` (``u`` half an ulp), hence a
  row's lse and target logit by at most ``u max|z|`` each (softcap and label
  smoothing are 1-Lipschitz; z_loss scales the lse's share by
  ``1 + 2 z_loss |lse|``), and each probability by at most ``p 2 u max|z|``.
  Returns the bound on the reduced loss (per row for ``reduction="none"``) and
  each row's ``2 u max|z|`` (weighted as the loss is), for the gradients.
  """
  _, rows, logits, _, lse = reference_dlogits(problem, **kwargs)
  valid = rows.valid
  reduction = kwargs.get("reduction", "mean")
  weight = valid / max(1, valid.sum()) if reduction == "mean" else valid * 1.0
  shift = 2 * _BF16_HALF_ULP * np.abs(logits).max(axis=1)
  z_loss = kwargs.get("z_loss", 0.0)
  per_row = shift * (1 + 2 * z_loss * np.abs(lse)) * weight
  loss_bound = per_row if reduction == "none" else per_row.sum()
  return loss_bound, shift * weight


def _dlogits_rounding_bounds(problem, kwargs):
  """Per gradient, how far rounding dlogits to the compute dtype can move it."""
  dlogits, rows, _, _, _ = reference_dlogits(problem, **kwargs)
  eps = _DLOGITS_EPS.get(np.dtype(problem.hidden.dtype).name, 2.0**-22)
  # p - 1 at a confident label cancels: about an ulp of the row's weight.
  valid, labels = rows.valid, rows.labels
  mean = kwargs.get("reduction", "mean") == "mean"
  row_weight = valid / max(1, valid.sum()) if mean else valid.astype(float)
  in_range = valid & (labels >= 0) & (labels < dlogits.shape[1])
  magnitude = np.abs(dlogits)
  rows_in = np.flatnonzero(in_range)
  magnitude[rows_in, labels[in_range]] += row_weight[in_range] * 2.0**-22 / eps
  terms = (
    magnitude @ np.abs(rows.weight),  # dhidden rows
    magnitude.T @ np.abs(rows.hidden),  # dweight
    magnitude.sum(axis=0),  # dbias
  )
  return [eps * np.linalg.norm(term) for term in terms]


def rel_err(out, ref) -> float:
  """``||out - ref|| / ||ref||``; the absolute error where ``ref`` is 0."""
  out, ref = to64(out), np.asarray(ref, np.float64)
  num = np.linalg.norm((out - ref).ravel())
  den = np.linalg.norm(ref.ravel())
  return float(num / den) if den else float(num)


def assert_close(out, ref, rtol, what="", atol=0.0):
  """``||out - ref|| <= rtol * ||ref|| + atol``, and no NaN."""
  out64 = to64(out)
  assert out64.shape == np.shape(ref), (what, out64.shape, np.shape(ref))
  assert not np.isnan(out64).any(), f"{what}: NaN in output"
  num = np.linalg.norm((out64 - np.asarray(ref, np.float64)).ravel())
  den = np.linalg.norm(np.asarray(ref, np.float64).ravel())
  assert num <= rtol * den + atol, (
    f"{what}: error {num:.3g} > {rtol:.3g} x {den:.3g} + {atol:.3g}"
    f" (relative {num / den if den else num:.3g})"
  )


# Rounding dlogits to the compute dtype perturbs each of a gradient's matmul
# terms by up to this much of the term (bf16 and f16 dlogits are rounded on
# purpose, as in full-logits autodiff; float32 ones lose about an ulp of 1
# where p - 1 cancels for a confident label).
_DLOGITS_EPS = {"float32": 2.0**-22, "bfloat16": 2.0**-8, "float16": 2.0**-10}


def check_against_oracle(
  problem,
  dtype,
  *,
  loss_rtol=None,
  grad_rtol=None,
  naive_factor=NAIVE_FACTOR,
  **kwargs,
):
  """Runs ``mst_jax.linear_cross_entropy`` and compares with the oracle.

  Gradients of bfloat16 heads (inputs or logits) are held to
  ``naive_factor`` x the naive head's error on the same problem
  (``check_grads_against_naive``), others to the dtype's rtol.
  """
  loss, grads = value_and_grads(mst_jax.linear_cross_entropy, problem, **kwargs)
  ref_loss, ref_grads = oracle(problem, **kwargs)
  assert loss.dtype == jnp.float32
  # A loss near 0 (a confident right answer) is lse - target, two numbers of
  # lse's size: its float32 error is relative to that size, not to the loss.
  rtol = loss_rtol or LOSS_RTOL[dtype]
  atol = rtol * np.sqrt(np.size(ref_loss))
  if bf16_logits(problem, kwargs):
    atol += np.linalg.norm(_logits_rounding(problem, kwargs)[0])
  assert_close(loss, ref_loss, rtol, "loss", atol=atol)
  names = ("dhidden", "dweight", "dbias")[: len(grads)]
  inputs = (problem.hidden, problem.weight, problem.bias)[: len(grads)]
  for name, x, g in zip(names, inputs, grads, strict=True):
    assert g.dtype == x.dtype, (name, g.dtype, x.dtype)
  if _naive_logits_dtype(problem, kwargs) is not None:
    check_grads_against_naive(problem, grads, ref_grads, naive_factor, **kwargs)
    return loss, grads
  # Beyond rtol (the output's rounding), allow the rounding of dlogits: each
  # gradient is a sum of terms dlogits x operand, and rounding perturbs each
  # term; sums that cancel (V=2, few rows) make that large relative to the sum.
  # The bound costs a float64 pass, so it is computed only when rtol is not met.
  atols = None
  for index, (name, g, ref) in enumerate(zip(names, grads, ref_grads, strict=True)):
    rtol = grad_rtol or GRAD_RTOL[dtype]
    if rel_err(g, ref) <= rtol:
      continue
    atols = atols or _dlogits_rounding_bounds(problem, kwargs)
    assert_close(g, ref, rtol, name, atol=atols[index])
  return loss, grads


def jaxpr_eqns(jaxpr):
  """Every equation of a jaxpr, recursing into sub-jaxprs (scan, cond, jit...)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          yield from jaxpr_eqns(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          yield from jaxpr_eqns(sub)


def output_shapes(fn, *args, primitive):
  """Output shapes of every ``primitive`` equation in ``fn``'s jaxpr."""
  jaxpr = jax.make_jaxpr(fn)(*args)
  return [
    tuple(v.aval.shape)
    for eqn in jaxpr_eqns(jaxpr.jaxpr)
    if eqn.primitive.name == primitive
    for v in eqn.outvars
  ]


def matmul_shapes(fn, *args):
  """Output shapes of the matrix products in ``fn``'s jaxpr: its
  ``dot_general``s with a matrix out (not the row sums that XLA:CPU's
  cross-entropy forms as matrix-vector products: ``XlaChunkCE``)."""
  return [s for s in output_shapes(fn, *args, primitive="dot_general") if len(s) >= 2]
