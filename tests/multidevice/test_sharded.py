"""Multi-device: data and vocab parallel on 8 simulated CPU devices.

These need ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before JAX
starts: ``tests/test_multidevice.py`` runs this directory in a fresh process
with that flag (a plain run on fewer devices does not collect it).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import oracle as oracle64
import pytest
from conftest import (
  assert_close,
  check_against_oracle,
  make_problem,
  matmul_shapes,
  oracle,
  to64,
)
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_log_probs_at_ids import ids_oracle, ids_problem

import mst_jax

N_DEVICES = 8
MESHES = [(8, 1), (1, 8), (2, 4), (4, 2)]
# V = 1032 splits into 8 shards of 129 or 4 of 258: neither a multiple of the
# kernels' vocabulary blocks.
N, D, V = 48, 16, 1032
OPTIONS = dict(label_smoothing=0.1, z_loss=1e-3, logit_softcap=4.0)


def _mesh(shape):
  return Mesh(np.array(jax.devices()[:N_DEVICES]).reshape(shape), ("data", "model"))


@pytest.mark.parametrize("vocab_block_size", [None, 50], ids=["rows", "vocab_blocks"])
@pytest.mark.parametrize("grad_mode", ["fused", "recompute"])
@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_meshes_match_the_oracle(rng, shape, grad_mode, vocab_block_size):
  """vocab_blocks: each shard's 129 to 1032 columns in 50-column blocks."""
  problem = make_problem(rng, (N,), dim=D, vocab=V, bias=True, mask="scattered")
  check_against_oracle(
    problem,
    "float32",
    mesh=_mesh(shape),
    batch_axis="data",
    vocab_axis="model",
    impl="xla",
    chunk_size=4,
    vocab_block_size=vocab_block_size,
    grad_mode=grad_mode,
    **OPTIONS,
  )


@pytest.mark.parametrize("grad_mode", ["fused", "recompute"])
@pytest.mark.parametrize("shape", [(1, 8), (2, 4)], ids=["1x8", "2x4"])
def test_dhidden_summed_over_shards_in_row_pieces(rng, monkeypatch, shape, grad_mode):
  """``VocabShard.sum_partial`` all-reduces a group's rows a piece at a time.

  Pieces of 5 rows: each chunk of 23 rows (on 1 or 2 row shards) is 4 whole
  pieces and a tail of 3, every one summed once.
  """
  monkeypatch.setattr(mst_jax._sweep.mesh, "_SUM_PIECE_BYTES", 5 * D * 4)
  problem = make_problem(rng, (N,), dim=D, vocab=V, bias=True, mask="scattered")
  kwargs = dict(mesh=_mesh(shape), batch_axis="data", vocab_axis="model")
  kwargs.update(impl="xla", chunk_size=23, grad_mode=grad_mode, **OPTIONS)
  check_against_oracle(problem, "float32", **kwargs)
  jaxpr = jax.make_jaxpr(
    jax.grad(
      lambda h: mst_jax.linear_cross_entropy(
        h, problem.weight, problem.labels, **kwargs
      )
    )
  )(problem.hidden)
  summed = {
    str(eqn.outvars[0].aval.shape)
    for eqn in _all_eqns(jaxpr.jaxpr)
    if eqn.primitive.name == "psum" and eqn.outvars[0].aval.ndim == 2
  }
  assert summed == {"(5, 16)", "(3, 16)"}, summed


def _all_eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        sub = getattr(sub, "jaxpr", sub)
        if isinstance(sub, jax.extend.core.Jaxpr):
          yield from _all_eqns(sub)


@pytest.mark.parametrize("shape", [(8, 1), (2, 4)], ids=["8x1", "2x4"])
def test_devices_without_a_valid_token(rng, shape):
  """The first half of the rows is masked: half the row shards hold none."""
  problem = make_problem(rng, (N,), dim=D, vocab=V, bias=True, mask="none")
  problem.where = jnp.asarray(np.arange(N) >= N // 2)
  check_against_oracle(
    problem,
    "float32",
    mesh=_mesh(shape),
    batch_axis="data",
    vocab_axis="model",
    impl="xla",
    chunk_size=4,
    **OPTIONS,
  )


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reductions_and_aux(rng, reduction):
  problem = make_problem(rng, (4, 12), dim=D, vocab=V, mask="prefix")
  kwargs = dict(mesh=_mesh((2, 4)), batch_axis="data", vocab_axis="model", impl="xla")
  check_against_oracle(problem, "float32", reduction=reduction, **kwargs)
  _, aux = mst_jax.linear_cross_entropy(*problem.args, return_aux=True, **kwargs)
  _, ref = mst_jax.reference.linear_cross_entropy(*problem.args, return_aux=True)
  np.testing.assert_allclose(aux.lse, ref.lse, rtol=1e-5)
  assert int(aux.n_correct) == int(ref.n_correct)
  assert int(aux.n_valid) == int(ref.n_valid)


def test_pallas_kernels_in_each_shard(rng):
  problem = make_problem(rng, (N,), dim=D, vocab=V, bias=True, mask="scattered")
  check_against_oracle(
    problem,
    "float32",
    mesh=_mesh((2, 4)),
    batch_axis="data",
    vocab_axis="model",
    impl="pallas",
    **OPTIONS,
  )


@pytest.mark.parametrize("axes", [("data", None), (None, "model")], ids=["dp", "vp"])
def test_one_axis_only_and_dv_layout(rng, axes):
  problem = make_problem(
    rng, (N,), dim=D, vocab=V, weight_layout="dv", mask="scattered"
  )
  check_against_oracle(
    problem,
    "float32",
    mesh=_mesh((4, 2)),
    batch_axis=axes[0],
    vocab_axis=axes[1],
    weight_layout="dv",
    impl="xla",
  )


def test_no_weight_all_gather_and_no_full_logits(rng):
  problem = make_problem(rng, (N,), dim=D, vocab=V, mask="scattered")
  mesh = _mesh((2, 4))
  hidden = jax.device_put(problem.hidden, NamedSharding(mesh, P("data", None)))
  weight = jax.device_put(problem.weight, NamedSharding(mesh, P("model", None)))

  def loss(hidden, weight):
    return mst_jax.linear_cross_entropy(
      hidden,
      weight,
      problem.labels,
      where=problem.where,
      mesh=mesh,
      batch_axis="data",
      vocab_axis="model",
      impl="xla",
      chunk_size=4,
    )

  hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(hidden, weight)
  text = hlo.compile().as_text()
  assert "all-gather" not in text
  # Logits exist only as [chunk, V / 4] = [4, 258] per device.
  widths = {int(m) for m in re.findall(r"\[(\d+),258\]", text)}
  assert widths and max(widths) <= 4, widths
  assert "1032]" not in text


@pytest.mark.parametrize("grad_mode", ["fused", "recompute"])
def test_the_gpu_program_lowers_for_cuda_on_a_mesh(as_if_on_hopper, grad_mode):
  """impl="mosaic" in each shard of a 2 x 4 mesh lowers for CUDA: the Mosaic
  GEMMs and cross-entropy kernels inside ``shard_map`` (32 rows and 512
  columns of a 2048-column vocabulary per device, whole TMA tiles)."""
  mesh = _mesh((2, 4))
  h = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((2048, 64), jnp.bfloat16)
  y = jax.ShapeDtypeStruct((64,), jnp.int32)

  def loss(hidden, weight, labels):
    return mst_jax.linear_cross_entropy(
      hidden,
      weight,
      labels,
      mesh=mesh,
      batch_axis="data",
      vocab_axis="model",
      impl="mosaic",
      chunk_size=16,
      grad_mode=grad_mode,
    )

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  text = step.trace(h, w, y).lower(lowering_platforms=("cuda",)).as_text()
  # The statistics in the logits GEMM's epilogue, dlogits in Mosaic's kernel
  # (the fallback's would be Triton).
  assert "mst_jax_mosaic_gemm" in text and "_rows_mosaic" in text
  assert "triton" not in text


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("vocab_block_size", [None, 50], ids=["rows", "vocab_blocks"])
def test_token_and_class_weights_on_a_mesh(rng, vocab_block_size, eps):
  """Class weights are sharded with the vocabulary (their weighted mean
  combined across shards) and the label's weight taken whole; without
  smoothing only the label's weight reaches the chunks."""
  problem = make_problem(rng, (N,), dim=D, vocab=V, bias=True, mask="scattered")
  weights = jnp.asarray(rng.random(N) * 2.0, jnp.float32)
  kwargs = dict(
    where=problem.where,
    token_weights=weights,
    class_weights=jnp.asarray(rng.random(V) * 2.0, jnp.float32),
    label_smoothing=eps,
    impl="xla",
    chunk_size=4,
    vocab_block_size=vocab_block_size,
  )
  mesh = dict(mesh=_mesh((2, 4)), batch_axis="data", vocab_axis="model")

  def step(**extra):
    loss = lambda h, w, b: mst_jax.linear_cross_entropy(
      h, w, problem.labels, b, **kwargs, **extra
    )
    args = (problem.hidden, problem.weight, problem.bias)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*args)

  for out, ref in zip(
    jax.tree.leaves(step(**mesh)), jax.tree.leaves(step()), strict=True
  ):
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
  "shape, options",
  [
    ((1, 8), dict(chunk_size=4)),
    ((2, 4), dict(chunk_size=4, vocab_block_size=50)),
    ((1, 8), {}),  # at least D rows a device, one group: logits kept
    ((2, 4), {}),
  ],
  ids=["1x8", "2x4_blocks", "1x8_kept", "2x4_kept"],
)
def test_log_probs_and_entropy_on_a_mesh(rng, shape, options):
  """Shards combine the entropy's expected score; values and gradients of both
  outputs (random cotangents) match the float64 full-logits reference. By
  default each device keeps its logits shard (3 matmuls in the program)."""
  problem = make_problem(rng, (N,), dim=D, vocab=V, bias=True, mask="scattered")
  g_lp, g_h = (jnp.asarray(rng.standard_normal(N), jnp.float32) for _ in range(2))

  def total(fn, hidden, weight, bias, **kwargs):
    lp, h = fn(
      hidden,
      weight,
      problem.labels,
      bias,
      where=problem.where,
      return_entropy=True,
      logit_softcap=4.0,
      **kwargs,
    )
    return jnp.sum(lp * g_lp + h * g_h), (lp, h)

  mesh = dict(mesh=_mesh(shape), batch_axis="data", vocab_axis="model")
  args = (problem.hidden, problem.weight, problem.bias)
  step = jax.value_and_grad(total, argnums=(1, 2, 3), has_aux=True)
  meshed = functools.partial(mst_jax.linear_log_probs, impl="xla", **options, **mesh)
  if not options:
    assert len(matmul_shapes(functools.partial(step, meshed), *args)) == 3
  # Under jax.jit, as in a training step.
  (_, outputs), grads = jax.jit(functools.partial(step, meshed))(*args)
  with jax.enable_x64(True):
    args64 = [jnp.asarray(to64(x)) for x in args]
    (_, ref_outputs), ref_grads = step(oracle64.log_probs, *args64)
  for out, ref in zip((*outputs, *grads), (*ref_outputs, *ref_grads), strict=True):
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("shape", [(8, 1), (1, 8), (2, 4)], ids=str)
def test_log_probs_at_several_ids_on_a_mesh(rng, shape):
  """``labels [..., K]`` on a mesh: values, entropy and gradients against the
  float64 oracle column by column (tests/test_log_probs_at_ids.py's)."""
  arrays, ids, where = ids_problem(rng, (4, 12), D, V, 5, "float32", "vd", True)
  cotangents = [rng.standard_normal(s) for s in (ids.shape, ids.shape[:-1])]
  mesh = dict(mesh=_mesh(shape), batch_axis="data", vocab_axis="model")
  names = ("hidden", "weight", "bias")

  ref_lp, ref_h, ref_grads = ids_oracle(arrays, ids, where, cotangents, shift=True)

  def total(*args):
    lp, h = mst_jax.linear_log_probs(
      *args[:2], ids, args[2], where=where, return_entropy=True, shift=True, **mesh
    )
    g_lp, g_h = (jnp.asarray(c, lp.dtype) for c in cotangents)
    return jnp.sum(lp * g_lp) + jnp.sum(h * g_h), (lp, h)

  step = jax.jit(jax.value_and_grad(total, argnums=(0, 1, 2), has_aux=True))
  (_, (lp, h)), grads = step(*(arrays[n] for n in names))
  for out, ref in zip((lp, h, *grads), (ref_lp, ref_h, *ref_grads), strict=True):
    np.testing.assert_allclose(np.asarray(out), ref, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vocab_parallel_halves_the_per_device_temporaries(dtype):
  """Compile only: each of two vocab shards holds at most 0.6x of one device.

  The default budget is divided over the vocabulary axis, so each device plans
  the row groups one device would, over half the columns.
  """
  n_rows, dim, vocab = 4096, 256, 32768
  mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"))

  def temp_bytes(fn, weight_spec):
    shape = lambda s, dt, spec: jax.ShapeDtypeStruct(
      s, dt, sharding=NamedSharding(mesh, spec)
    )
    args = (
      shape((n_rows, dim), dtype, P()),
      shape((vocab, dim), dtype, weight_spec),
      shape((n_rows,), jnp.int32, P()),
    )
    step = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
    return step.lower(*args).compile().memory_analysis().temp_size_in_bytes

  one = temp_bytes(mst_jax.linear_cross_entropy, P())
  sharded = temp_bytes(
    lambda h, w, y: mst_jax.linear_cross_entropy(
      h, w, y, mesh=mesh, vocab_axis="model"
    ),
    P("model"),
  )
  assert sharded <= 0.6 * one, (sharded, one)


def test_plain_gspmd_sharded_inputs(rng):
  """No mesh argument: sharded inputs under jit, partitioned by XLA."""
  problem = make_problem(rng, (N,), dim=D, vocab=V, bias=True, mask="scattered")
  mesh = _mesh((2, 4))
  problem.hidden = jax.device_put(problem.hidden, NamedSharding(mesh, P("data", None)))
  problem.weight = jax.device_put(problem.weight, NamedSharding(mesh, P("model", None)))
  check_against_oracle(problem, "float32", impl="xla", chunk_size=8, **OPTIONS)


def test_mesh_arguments_are_checked(rng):
  problem = make_problem(rng, (N,), dim=D, vocab=V)
  mesh = _mesh((2, 4))
  call = lambda **kw: mst_jax.linear_cross_entropy(*problem.args, **kw)
  with pytest.raises(ValueError, match="pass mesh="):
    call(batch_axis="data")
  with pytest.raises(ValueError, match="not an axis of the mesh"):
    call(mesh=mesh, batch_axis="rows")
  with pytest.raises(ValueError, match="give batch_axis, vocab_axis or both"):
    call(mesh=mesh)
  with pytest.raises(ValueError, match="must differ"):
    call(mesh=mesh, batch_axis="data", vocab_axis="data")
  odd = make_problem(rng, (N,), dim=D, vocab=V - 1)
  with pytest.raises(ValueError, match=r"vocabulary \(1031\) must split evenly"):
    mst_jax.linear_cross_entropy(*odd.args, mesh=mesh, vocab_axis="model")
  with pytest.raises(ValueError, match="47 tokens must split evenly"):
    mst_jax.linear_cross_entropy(
      problem.hidden[:47],
      problem.weight,
      problem.labels[:47],
      mesh=mesh,
      batch_axis="data",
    )


@pytest.mark.parametrize("parallel", ["data", "vocab"])
@pytest.mark.parametrize("impl", ["naive", "mst_jax:chunk_size=32"])
def test_benchmark_parallel_cases_match_one_device(parallel, impl):
  """What ``python -m mst_jax.bench --cases llama_16k_dp ...`` runs on GPUs."""
  from mst_jax.bench.cases import CASES, make_inputs, make_loss

  small = dict(tokens=128, dim=16, vocab=1032, dtype="float32", devices=N_DEVICES)
  one = dataclasses.replace(CASES["llama_16k"], **small)
  many = dataclasses.replace(CASES["llama_16k"], **small, parallel=parallel)
  inputs = make_inputs(many)
  spec = inputs[1].sharding.spec if parallel == "vocab" else inputs[0].sharding.spec
  assert spec[0] == ("model" if parallel == "vocab" else "data")
  step = lambda case: jax.jit(jax.value_and_grad(make_loss(impl, case), (0, 1)))
  want = step(one)(*make_inputs(one))
  got = step(many)(*inputs)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-7)


def _collective_scan_depths(jaxpr, depth=0):
  """The ``lax.scan`` nesting depth of every pmax/psum/pmin in ``jaxpr``."""
  depths = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("pmax", "psum", "pmin"):
      depths.append(depth)
    inner = depth + (eqn.primitive.name == "scan")
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        sub = getattr(sub, "jaxpr", sub)
        if isinstance(sub, jax.extend.core.Jaxpr):
          depths += _collective_scan_depths(sub, inner)
  return depths


def test_vocab_blocks_combine_shards_once_per_row_chunk(rng):
  """The model-axis collectives sit in the row-chunk scan, not the block scan."""
  problem = make_problem(rng, (N,), dim=D, vocab=V, mask="none")
  f = lambda h, w: mst_jax.linear_cross_entropy(
    h,
    w,
    problem.labels,
    mesh=_mesh((1, 8)),
    vocab_axis="model",
    impl="xla",
    chunk_size=16,
    vocab_block_size=16,
    reduction="none",
  )
  depths = _collective_scan_depths(
    jax.make_jaxpr(f)(problem.hidden, problem.weight).jaxpr
  )
  assert depths and set(depths) == {1}, depths


@pytest.mark.parametrize("vocab_block_size", [None, 50], ids=["rows", "vocab_blocks"])
def test_a_banned_shard(rng, vocab_block_size):
  """A bias of -inf on the first two of eight vocabulary shards: finite loss
  and gradients, equal to one device's."""
  problem = make_problem(rng, (N,), dim=D, vocab=V, bias=True, mask="none")
  bias = problem.bias.at[: 2 * V // 8].set(-jnp.inf)
  labels = jnp.maximum(problem.labels, 2 * V // 8)
  options = dict(impl="xla", chunk_size=4, vocab_block_size=vocab_block_size)

  def step(**mesh):
    loss = lambda h, w: mst_jax.linear_cross_entropy(
      h, w, labels, bias, **options, **mesh
    )
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(
      problem.hidden, problem.weight
    )

  meshed = step(mesh=_mesh((1, 8)), vocab_axis="model")
  for out, ref in zip(jax.tree.leaves(meshed), jax.tree.leaves(step()), strict=True):
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("shape", [(8, 1), (2, 4)], ids=["8x1", "2x4"])
def test_gradient_accumulation_across_data_parallel_devices(rng, shape):
  """The README's recipe on a mesh: micro-batches split over the data axis,
  each summed loss over the whole batch's valid count, gradients summed in a
  scan: the gradients of the whole batch's mean."""
  k = 3
  problem = make_problem(rng, (k * N,), dim=D, vocab=V, bias=True, mask="none")
  labels = np.asarray(problem.labels).copy()
  labels[: N + 8] = -100  # the first micro-batch holds no valid token
  problem.labels = jnp.asarray(labels)
  mesh = _mesh(shape)
  n_valid = jnp.sum(problem.labels != -100)

  def micro_loss(weight, bias, hidden, labels):
    loss = mst_jax.linear_cross_entropy(
      hidden,
      weight,
      labels,
      bias,
      reduction="sum",
      mesh=mesh,
      batch_axis="data",
      vocab_axis="model",
      impl="xla",
      chunk_size=4,
      **OPTIONS,
    )
    return loss / n_valid

  @jax.jit
  def accumulated(weight, bias):
    def body(carry, batch):
      loss, grads = jax.value_and_grad(micro_loss, argnums=(0, 1))(weight, bias, *batch)
      return jax.tree.map(jnp.add, carry, (loss, grads)), None

    zeros = (jnp.zeros(()), (jnp.zeros_like(weight), jnp.zeros_like(bias)))
    batches = (problem.hidden.reshape(k, N, D), problem.labels.reshape(k, N))
    return jax.lax.scan(body, zeros, batches)[0]

  loss, (dweight, dbias) = accumulated(problem.weight, problem.bias)
  problem.where = None
  ref_loss, ref_grads = oracle(problem, **OPTIONS)
  assert_close(loss, ref_loss, 1e-5, "loss")
  assert_close(dweight, ref_grads[1], 1e-5, "dweight")
  assert_close(dbias, ref_grads[2], 1e-5, "dbias")


@pytest.mark.parametrize(
  "grad_mode, vocab_block_size",
  [("fused", None), ("recompute", 50)],
  ids=["rows_fused", "vocab_blocks_recompute"],
)
def test_second_derivatives_on_a_vocab_sharded_mesh(rng, grad_mode, vocab_block_size):
  """Hessian-vector products (forward over reverse, and reverse over reverse)
  in float64 on a 2x4 mesh: the shards' max is a shift without derivative."""
  problem = make_problem(rng, (N,), dim=D, vocab=V, mask="scattered")
  mesh = dict(mesh=_mesh((2, 4)), batch_axis="data", vocab_axis="model")
  kwargs = dict(where=problem.where, label_smoothing=0.1, logit_softcap=4.0)

  def grads(fn, hidden, weight, **extra):
    loss = functools.partial(fn, labels=problem.labels, **kwargs, **extra)
    return jax.grad(loss, argnums=(0, 1))(hidden, weight)

  def second(fn, hidden, weight, direction, **extra):
    forward = jax.jvp(lambda h: grads(fn, h, weight, **extra), (hidden,), (direction,))
    backward = jax.grad(lambda h: jnp.sum(grads(fn, h, weight, **extra)[1] ** 2))(
      hidden
    )
    return (*forward[1], backward)

  with jax.enable_x64(True):
    hidden, weight = (jnp.asarray(to64(x)) for x in (problem.hidden, problem.weight))
    direction = jnp.asarray(rng.standard_normal(hidden.shape))
    out = second(
      mst_jax.linear_cross_entropy,
      hidden,
      weight,
      direction,
      impl="xla",
      chunk_size=4,
      grad_mode=grad_mode,
      vocab_block_size=vocab_block_size,
      **mesh,
    )
    ref = second(oracle64.cross_entropy, hidden, weight, direction)
  for o, r in zip(out, ref, strict=True):
    np.testing.assert_allclose(np.asarray(o), np.asarray(r), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("grad_mode", ["fused", "recompute"])
@pytest.mark.parametrize(
  "shape, axes",
  [((1, 8), dict(vocab_axis="model")), ((2, 4), dict(batch_axis="data"))],
  ids=["vocab_parallel", "data_parallel"],
)
def test_rows_appended_on_each_device(appended, rng, grad_mode, shape, axes):
  """Rows appended to each device's block of rows (all rows when vocab
  parallel, half of them on each of 2 data-parallel groups) count for
  nothing."""
  problem = make_problem(rng, (N - 2,), dim=D, vocab=V, bias=True, mask="scattered")
  kwargs = dict(impl="xla", chunk_size=16, grad_mode=grad_mode, **OPTIONS)
  check_against_oracle(problem, "float32", mesh=_mesh(shape), **axes, **kwargs)
  assert set(appended) == {(N - 2) // shape[0]}


@pytest.mark.parametrize("grad_mode", [None, "recompute"])
def test_rows_appended_on_each_device_of_both_axes(appended, rng, grad_mode):
  """Rows and vocabulary split: each data-parallel group's rows get their
  own appended rows, per-token losses included (by default fused for the
  mean, the forward's logits kept for the per-token losses)."""
  problem = make_problem(rng, (4, N // 4 - 1), dim=D, vocab=V, mask="prefix")
  mesh = dict(mesh=_mesh((4, 2)), batch_axis="data", vocab_axis="model")
  kwargs = dict(impl="xla", grad_mode=grad_mode, **OPTIONS)
  check_against_oracle(problem, "float32", **mesh, **kwargs)
  check_against_oracle(problem, "float32", reduction="none", **mesh, **kwargs)
  assert set(appended) == {N // 4 - 1}


@pytest.mark.parametrize(
  "shape, axes",
  [((1, 8), dict(vocab_axis="model")), ((8, 1), dict(batch_axis="data"))],
  ids=["vocab_parallel", "data_parallel"],
)
def test_an_unaligned_sharded_step_lowers_to_mosaic_kernels_only(
  as_if_on_hopper, shape, axes
):
  """1001 rows on each device, vocab parallel (512 columns each) or data
  parallel (8 x 1001 rows): the rows appended let the Mosaic kernels take
  the one group of each device's rows."""
  mesh = _mesh(shape)
  n_rows = 1001 * shape[0]
  h = jax.ShapeDtypeStruct((n_rows, 128), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((4096, 128), jnp.bfloat16)
  y = jax.ShapeDtypeStruct((n_rows,), jnp.int32)

  def loss(hidden, weight, labels):
    return mst_jax.linear_cross_entropy(hidden, weight, labels, mesh=mesh, **axes)

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  text = step.trace(h, w, y).lower(lowering_platforms=("cuda",)).as_text()
  assert "mst_jax_mosaic_gemm" in text and "_rows_mosaic" in text
  assert "triton" not in text and "stablehlo.dot_general" not in text


def test_a_dv_weight_whose_shards_tma_cannot_copy_is_transposed(as_if_on_hopper):
  """V = 8 x 1001 over 8 vocab shards: each device's ``[D, 1001]`` columns
  are not whole TMA rows (the whole weight's 8008 are), so the weight is
  transposed once and every product and the cross-entropy run on Mosaic
  kernels; ``dweight`` comes back sharded like the weight."""
  mesh = _mesh((1, 8))
  h = jax.ShapeDtypeStruct((1000, 128), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((128, 8 * 1001), jnp.bfloat16)
  y = jax.ShapeDtypeStruct((1000,), jnp.int32)

  def loss(hidden, weight, labels):
    return mst_jax.linear_cross_entropy(
      hidden, weight, labels, mesh=mesh, vocab_axis="model", weight_layout="dv"
    )

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  text = step.trace(h, w, y).lower(lowering_platforms=("cuda",)).as_text()
  assert "mst_jax_mosaic_gemm" in text and "_rows_mosaic" in text
  assert "triton" not in text and "stablehlo.dot_general" not in text
  assert text.count("stablehlo.transpose") == 2


def test_vocab_blocks_plan_a_transposed_weight_with_the_undivided_budget(
  as_if_on_hopper, planned
):
  """Vocabulary blocks plan with the whole default budget on a vocab-sharded
  mesh (a row's cost does not depend on V): so does the transposed copy of
  a ``[D, V]`` weight, less the copies."""
  from mst_jax._losses import cross_entropy as _cross_entropy

  mesh = _mesh((1, 8))
  d, local = 1024, 50257
  h = jax.ShapeDtypeStruct((4096, d), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((d, 8 * local), jnp.bfloat16)
  y = jax.ShapeDtypeStruct((4096,), jnp.int32)

  def loss(hidden, weight, labels):
    return mst_jax.linear_cross_entropy(
      hidden,
      weight,
      labels,
      mesh=mesh,
      vocab_axis="model",
      weight_layout="dv",
      vocab_block_size=8192,
    )

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  step.trace(h, w, y).lower(lowering_platforms=("cuda",))
  copies = 2 * d * local * 2
  assert planned == [("vd", _cross_entropy.DEFAULT_MEMORY_BUDGET - copies)]


def test_a_transposed_dv_weight_on_a_mesh_matches_the_oracle(rng, monkeypatch):
  """The transposition forced on XLA's backend (it runs on any host), vocab
  and data parallel: loss and gradients against the float64 oracle,
  ``dweight`` back in ``[D, V]``."""
  from mst_jax._kernels.xla import XlaChunkCE

  monkeypatch.setattr(XlaChunkCE, "transposes_weight", lambda self, x, head: True)
  problem = make_problem(rng, (N,), dim=D, vocab=V, weight_layout="dv")
  for grad_mode in ("fused", "recompute"):
    check_against_oracle(
      problem,
      "float32",
      mesh=_mesh((2, 4)),
      batch_axis="data",
      vocab_axis="model",
      weight_layout="dv",
      impl="xla",
      chunk_size=4,
      grad_mode=grad_mode,
      **OPTIONS,
    )
