"""Multi-device: meshes with Explicit axes (``jax.make_mesh``'s default).

On such a mesh an array's sharding is part of its type. Inputs typed so are
read as a layout (rows over the leading axis's mesh axes, the vocabulary over
the weight's V axis's) and run sharded without a ``mesh=`` argument; anything
else about their sharding is resharded first. Run by ``tests/test_multidevice.py``
on 8 simulated CPU devices.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import oracle as oracle64
import pytest
from conftest import GRAD_RTOL, LOSS_RTOL, assert_close, make_problem, oracle, to64
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import mst_jax
from mst_jax._losses import distillation as _distillation

B, T, D, V = 8, 12, 16, 1032
OPTIONS = dict(label_smoothing=0.1, z_loss=1e-3, logit_softcap=4.0)


def _mesh(shape=(4, 2), axis_types=AxisType.Explicit):
  return jax.make_mesh(
    shape,
    ("data", "model"),
    axis_types=(axis_types,) * 2,
    devices=jax.devices()[: np.prod(shape)],
  )


def _put(x, mesh, *spec):
  return None if x is None else jax.device_put(x, NamedSharding(mesh, P(*spec)))


# (hidden [B, T, D], weight [V, D], labels [B, T], bias [V]) specs.
SHARDINGS = {
  "rows_and_vocab": (("data", None, None), ("model", None), ("data", None), ("model",)),
  # FSDP: the weight split over the rows' axis is gathered.
  "fsdp_weight": (("data", None, None), ("data", None), ("data", None), (None,)),
  "rows_over_both_axes": ((("data", "model"), None, None), (None, None), (), ()),
  # A split sequence or D axis is gathered; the labels' own split is ignored.
  "sequence_and_d": ((None, "data", "model"), (None, "model"), (None, "data"), ()),
}


def _check_typed_result(problem, value, grads, inputs, **options):
  """The loss and gradients against the oracle; each gradient has its
  input's type (sharding included)."""
  ref_value, ref_grads = oracle(problem, **options, **OPTIONS)
  assert_close(value, ref_value, LOSS_RTOL["float32"] * 10, "loss")
  for name, g, ref in zip(
    ("dhidden", "dweight", "dbias"), grads, ref_grads, strict=True
  ):
    assert_close(g, ref, GRAD_RTOL["float32"], name)
  for g, x in zip(grads, inputs, strict=True):
    assert jax.typeof(g).sharding.spec == jax.typeof(x).sharding.spec


@pytest.mark.parametrize("class_weights", [False, True], ids=["", "class_weights"])
@pytest.mark.parametrize("grad_mode", ["fused", "recompute"])
@pytest.mark.parametrize("sharding", list(SHARDINGS))
def test_explicit_inputs_under_jit_without_a_mesh_argument(
  rng, sharding, grad_mode, class_weights
):
  """With ``class_weights`` (sharded like the bias), each row's label's
  weight is gathered into the rows' sharding."""
  problem = make_problem(rng, (B, T), dim=D, vocab=V, bias=True, mask="scattered")
  mesh = _mesh()
  specs = SHARDINGS[sharding]
  args = [_put(x, mesh, *s) for x, s in zip(problem.args, specs, strict=True)]
  where = _put(problem.where, mesh, *specs[2])
  weighted = {}
  if class_weights:
    weighted["class_weights"] = jnp.asarray(rng.uniform(0.2, 3.0, V), jnp.float32)

  def loss(hidden, weight, bias):
    return mst_jax.linear_cross_entropy(
      hidden,
      weight,
      args[2],
      bias,
      where=where,
      impl="xla",
      chunk_size=4,
      grad_mode=grad_mode,
      **{k: _put(x, mesh, *specs[3]) for k, x in weighted.items()},
      **OPTIONS,
    )

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  value, grads = step(args[0], args[1], args[3])
  inputs = (args[0], args[1], args[3])
  _check_typed_result(problem, value, grads, inputs, **weighted)


@pytest.mark.parametrize(
  "mesh_shape, row_axis, per_device",
  [((1, 8), None, 52), ((4, 2), "data", 13)],
  ids=["vocab_parallel", "rows_and_vocab"],
)
def test_rows_appended_on_explicit_inputs(
  rng, appended, mesh_shape, row_axis, per_device
):
  """The vocabulary (and the bias, whose largest entry labels the appended
  rows) split over the model axis, the rows whole or split over the data
  axis: 5 rows appended to each device's (forced: the rule appends none on
  a CPU) count for nothing, each gradient keeps its input's type, and the
  appending gathers nothing (the one gather finds the bias's largest entry
  across its shards, ``_args.inputs.finite_label``)."""
  problem = make_problem(rng, (4, 13), dim=D, vocab=V, bias=True, mask="scattered")
  mesh = _mesh(mesh_shape)
  specs = ((row_axis, None, None), ("model", None), (row_axis, None), ("model",))
  args = [_put(x, mesh, *s) for x, s in zip(problem.args, specs, strict=True)]
  where = _put(problem.where, mesh, row_axis, None)

  def loss(hidden, weight, bias):
    return mst_jax.linear_cross_entropy(
      hidden, weight, args[2], bias, where=where, impl="xla", **OPTIONS
    )

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  value, grads = step(args[0], args[1], args[3])
  _check_typed_result(problem, value, grads, (args[0], args[1], args[3]))
  assert set(appended) == {per_device}
  text = step.lower(args[0], args[1], args[3]).compile().as_text()
  gathers = [line for line in text.splitlines() if " all-gather(" in line]
  assert all("finite_label" in line for line in gathers), gathers


def test_rows_and_vocab_run_sharded_without_gathering_the_weight(rng):
  problem = make_problem(rng, (B * T,), dim=D, vocab=V, mask="scattered")
  mesh = _mesh((2, 4))
  hidden = _put(problem.hidden, mesh, "data", None)
  weight = _put(problem.weight, mesh, "model", None)
  labels = _put(problem.labels, mesh, "data")

  def loss(hidden, weight):
    return mst_jax.linear_cross_entropy(
      hidden, weight, labels, impl="xla", chunk_size=4
    )

  text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(hidden, weight)
  text = text.compile().as_text()
  assert "all-gather" not in text
  widths = {int(m) for m in re.findall(r"\[(\d+),258\]", text)}  # [chunk, V / 4]
  assert widths and max(widths) <= 4, widths
  assert "1032]" not in text


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_log_probs_with_shift_and_the_reference(rng, impl):
  problem = make_problem(rng, (B, T), dim=D, vocab=V, bias=True, mask="prefix")
  mesh = _mesh()
  hidden = _put(problem.hidden, mesh, "data", None, None)
  weight = _put(problem.weight, mesh, "model", None)
  bias = _put(problem.bias, mesh, "model")
  g_lp = jnp.asarray(rng.standard_normal((B, T)), jnp.float32)

  def total(fn, hidden, weight, bias, labels, **kwargs):
    lp, h = fn(hidden, weight, labels, bias, shift=True, return_entropy=True, **kwargs)
    return jnp.sum(lp * g_lp + h), (lp, h)

  step = jax.value_and_grad(total, argnums=(1, 2, 3), has_aux=True)
  labels = _put(problem.labels, mesh, "data", None)
  fn = functools.partial(mst_jax.linear_log_probs, impl=impl)
  (_, outputs), grads = jax.jit(functools.partial(step, fn))(
    hidden, weight, bias, labels
  )
  with jax.enable_x64(True):
    args64 = [jnp.asarray(to64(x)) for x in problem.args[:2] + (problem.bias,)]
    (_, ref_outputs), ref_grads = step(oracle64.log_probs, *args64, problem.labels)
  for out, ref in zip((*outputs, *grads), (*ref_outputs, *ref_grads), strict=True):
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("axis_types", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize(
  "mesh_argument", [True, False], ids=["mesh_arg", "no_mesh_arg"]
)
def test_eager_grad_inside_set_mesh(rng, axis_types, mesh_argument):
  """Eager ``jax.grad`` on an Explicit mesh needs ``jax.set_mesh`` (JAX's own
  rule: grad forms the loss's cotangent on the mesh); Auto axes too."""
  problem = make_problem(rng, (B * T,), dim=D, vocab=V, mask="scattered")
  mesh = _mesh((2, 4), axis_types)
  hidden = _put(problem.hidden, mesh, "data", None)
  weight = _put(problem.weight, mesh, "model", None)
  labels = _put(problem.labels, mesh, "data")
  where = _put(problem.where, mesh, "data")
  kwargs = (
    dict(mesh=mesh, batch_axis="data", vocab_axis="model") if mesh_argument else {}
  )

  def loss(hidden, weight):
    return mst_jax.linear_cross_entropy(hidden, weight, labels, where=where, **kwargs)

  with jax.set_mesh(mesh):
    value, grads = jax.value_and_grad(loss, argnums=(0, 1))(hidden, weight)
  ref_value, ref_grads = oracle(problem)
  assert_close(value, ref_value, LOSS_RTOL["float32"] * 10, "loss")
  for g, ref in zip(grads, ref_grads, strict=True):
    assert_close(g, ref, GRAD_RTOL["float32"], "grad")


# (student hidden [B, T, D], student weight [V, D], teacher hidden, teacher
# weight) specs; labels and where go as the student's hidden's rows.
DISTILL_SHARDINGS = {
  "rows": (("data", None, None), (None, None), ("data", None, None), (None, None)),
  "rows_and_vocab_weights": (
    ("data", None, None),
    ("model", None),
    ("data", None, None),
    ("model", None),
  ),
  "fsdp_weights": (
    ("data", None, None),
    ("data", None),
    ("data", None, None),
    ("data", None),
  ),
  "sequence_split": (
    (None, "data", "model"),
    (None, "model"),
    (None, "data", None),
    (None, None),
  ),
}


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("sharding", list(DISTILL_SHARDINGS))
def test_distillation_on_explicit_inputs(rng, sharding, reduction):
  """Each device runs its rows (data parallel; vocabulary-split weights are
  gathered); loss and student gradients match the float64 reference, and each
  gradient has its input's sharding."""
  d_t = 24
  problem = make_problem(rng, (B, T), dim=D, vocab=V, bias=True, mask="scattered")
  teacher_hidden = rng.standard_normal((B, T, d_t)).astype(np.float32)
  teacher_weight = (rng.standard_normal((V, d_t)) / np.sqrt(d_t)).astype(np.float32)
  g = jnp.asarray(rng.standard_normal((B, T)), jnp.float32)
  mesh = _mesh()
  specs = DISTILL_SHARDINGS[sharding]
  rows = specs[0][:2]
  hidden, weight, t_hidden, t_weight = (
    _put(x, mesh, *s)
    for x, s in zip(
      (problem.hidden, problem.weight, teacher_hidden, teacher_weight),
      specs,
      strict=True,
    )
  )
  labels, where = _put(problem.labels, mesh, *rows), _put(problem.where, mesh, *rows)

  def total(fn, hidden, weight, t_hidden, t_weight, labels, where, **kwargs):
    loss = fn(
      hidden,
      weight,
      t_hidden,
      t_weight,
      labels,
      where=where,
      reduction=reduction,
      temperature=2.0,
      hard_label_weight=0.3,
      **kwargs,
    )
    return jnp.sum(loss * g) if reduction == "none" else loss

  step = jax.value_and_grad(total, argnums=(1, 2))
  fn = functools.partial(mst_jax.linear_distillation_loss, chunk_size=8)
  value, grads = jax.jit(functools.partial(step, fn))(
    hidden, weight, t_hidden, t_weight, labels, where
  )
  with jax.enable_x64(True):
    wide = [jnp.asarray(to64(x)) for x in (problem.hidden, problem.weight)]
    wide += [jnp.asarray(x, jnp.float64) for x in (teacher_hidden, teacher_weight)]
    ref_value, ref_grads = step(
      oracle64.distillation,
      *wide,
      problem.labels,
      problem.where,
    )
  assert_close(value, ref_value, LOSS_RTOL["float32"] * 10, "loss")
  for name, out, ref in zip(("dhidden", "dweight"), grads, ref_grads, strict=True):
    assert_close(out, ref, GRAD_RTOL["float32"], name)
  for out, x in zip(grads, (hidden, weight), strict=True):
    assert jax.typeof(out).sharding.spec == jax.typeof(x).sharding.spec


def test_distillation_picks_its_gradient_mode_by_a_devices_rows(monkeypatch):
  """96 rows over 4 devices, 24 each, fewer than D=32: recompute, as the
  cross-entropy does (the fused mode's residual, a whole dweight, would be
  more than a device's logits); the same rows on one device: fused."""
  mesh = _mesh()
  shape = lambda *s: jnp.zeros(s, jnp.float32)
  args = (shape(96, 32), shape(V, 32), shape(96, 8), shape(V, 8))
  labels = jnp.zeros((96,), jnp.int32)
  fused, real = [], _distillation.reduced_loss

  def counted(*arrays):
    fused.append(True)
    return real(*arrays)

  monkeypatch.setattr(_distillation, "reduced_loss", counted)

  def loss(hidden, weight, t_hidden, t_weight):
    return mst_jax.linear_distillation_loss(
      hidden, weight, t_hidden, t_weight, labels, impl="xla"
    )

  split = [_put(x, mesh, "data", None) for x in args[::2]]
  jax.jit(jax.grad(loss)).trace(split[0], args[1], split[1], args[3])
  assert fused == []
  jax.jit(jax.grad(loss)).trace(*args)
  assert fused == [True]


def test_log_probs_at_several_ids_refuse_explicit_arrays_clearly(rng):
  """Several ids per position on Explicit-typed arrays: a clear error, not
  JAX's gather sharding error."""
  mesh = _mesh()
  problem = make_problem(rng, (B, T), dim=D, vocab=V)
  ids = jnp.stack([problem.labels] * 3, axis=-1)
  hidden = _put(problem.hidden, mesh, "data", None, None)
  with pytest.raises(NotImplementedError, match="Explicit axes"):
    mst_jax.linear_log_probs(hidden, problem.weight, ids)
