"""What the benchmark measures: named problem shapes and implementations."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mst_jax


@dataclasses.dataclass(frozen=True)
class Case:
  """One LM-head problem.

  Attributes:
    name: short name (used on the command line).
    tokens: N.
    dim: D.
    vocab: V.
    dtype: input dtype.
    mask: "none", "prefix" (the first ``masked_fraction`` of every sequence of
      ``seq_len`` tokens excluded, as in SFT) or "random" (``masked_fraction``
      of the tokens excluded at random positions).
    masked_fraction: see ``mask``.
    seq_len: sequence length for "prefix" masks.
    wrt: "hidden_weight" (gradients of both) or "hidden" (a frozen head).
    parallel: "" (one device), "data" (rows split over all local devices,
      the weight replicated) or "vocab" (the weight's rows split, the hidden
      states replicated). Inputs are placed that way; naive specs then run as
      plain GSPMD programs and ``mst_jax`` specs get ``mesh=`` with the
      matching ``batch_axis`` or ``vocab_axis``.
    devices: how many local devices a parallel case spans.
    objective: "cross_entropy" (the mean loss), "log_probs" (per-token
      log-probabilities and entropies, summed against fixed pseudo-random
      cotangents: what an RL step differentiates) or "distill" (the mean
      forward KL from a teacher head of hidden size ``teacher_dim`` to the
      student's; gradients of the student's hidden states and weight).
    teacher_dim: the teacher's hidden size ``D_t`` ("distill" only).
    weight_layout: "vd" (a ``[V, D]`` weight: an embedding table, a torch
      ``lm_head.weight``) or "dv" (``[D, V]``: a Flax Dense kernel;
      "cross_entropy" on one device only).
    description: one line for the table.
  """

  name: str
  tokens: int
  dim: int
  vocab: int
  dtype: str = "bfloat16"
  mask: str = "none"
  masked_fraction: float = 0.0
  seq_len: int = 2048
  wrt: str = "hidden_weight"
  parallel: str = ""
  devices: int = 1
  objective: str = "cross_entropy"
  teacher_dim: int = 0
  weight_layout: str = "vd"
  description: str = ""

  @property
  def argnums(self) -> tuple[int, ...]:
    return (0, 1) if self.wrt == "hidden_weight" else (0,)

  @property
  def flops(self) -> float:
    """Nominal FLOPs of value-and-grad: 2·N·D·V per matmul, 3 (or 2 frozen),
    and the teacher's logits (2·N·D_t·V) for "distill"."""
    student = 2.0 * self.tokens * self.dim * self.vocab * (1 + len(self.argnums))
    return student + 2.0 * self.tokens * self.teacher_dim * self.vocab

  def with_tokens(self, tokens: int) -> Case:
    return dataclasses.replace(self, name=f"{self.name}@{tokens}", tokens=tokens)

  @property
  def mesh(self) -> Mesh | None:
    """A ``("data", "model")`` mesh over the case's devices (None: one device)."""
    if not self.parallel:
      return None
    devices = jax.devices()
    if len(devices) < self.devices:
      raise Unsupported(f"needs {self.devices} devices, found {len(devices)}")
    shape = (self.devices, 1) if self.parallel == "data" else (1, self.devices)
    return Mesh(np.array(devices[: self.devices]).reshape(shape), ("data", "model"))

  @property
  def mesh_axes(self) -> dict:
    """``linear_cross_entropy``'s mesh arguments for this case."""
    if not self.parallel:
      return {}
    axis = {"data": "batch_axis", "vocab": "vocab_axis"}[self.parallel]
    return {"mesh": self.mesh, axis: "data" if self.parallel == "data" else "model"}


_LLAMA = dict(dim=4096, vocab=128256)


def _dv(case: Case) -> Case:
  """``case`` with ``[D, V]`` weights (Flax ``Dense`` kernels)."""
  description = f"{case.description}, [D, V] Flax kernels"
  name = f"{case.name}_dv"
  return dataclasses.replace(
    case, name=name, weight_layout="dv", description=description
  )


CASES = {
  c.name: c
  for c in [
    Case(
      "cpu",
      4096,
      64,
      151936,
      "float32",
      description="a narrow head with Qwen-2's vocabulary, for a CPU",
    ),
    Case("llama", 8192, **_LLAMA, description="Llama-3-8B head"),
    Case("gemma", 8192, 2304, 256000, description="Gemma-2-2B head"),
    Case(
      "llama_f16",
      8192,
      **_LLAMA,
      dtype="float16",
      description="Llama-3 head, float16 inputs (float32 logits)",
    ),
    Case("llama_32k", 32768, **_LLAMA, description="Llama-3 head, 32k tokens"),
    Case("gpt2", 8192, 1600, 50257, description="GPT-2-XL head, V = 50257"),
    Case(
      "llama_sft_prefix",
      8192,
      **_LLAMA,
      mask="prefix",
      masked_fraction=0.5,
      description="Llama-3 head, SFT (prompts masked)",
    ),
    Case(
      "llama_sft_random",
      8192,
      **_LLAMA,
      mask="random",
      masked_fraction=0.4,
      description="Llama-3 head, tokens masked at random",
    ),
    Case(
      "llama_frozen", 8192, **_LLAMA, wrt="hidden", description="Llama-3 head, frozen"
    ),
    Case(
      "llama_distill",
      8192,
      2048,
      128256,
      objective="distill",
      teacher_dim=4096,
      description="distillation into a smaller student",
    ),
    Case(
      "gpt2_distill",
      8192,
      1024,
      50257,
      objective="distill",
      teacher_dim=1600,
      description="distillation at GPT-2's vocabulary",
    ),
    Case(
      "llama_logprobs",
      8192,
      **_LLAMA,
      objective="log_probs",
      description="Llama-3 head, RL (log-probs and entropy)",
    ),
    # One GPU against two, data or vocab parallel.
    Case("llama_16k", 16384, **_LLAMA, description="Llama-3 head, one GPU"),
    Case(
      "llama_16k_dp",
      16384,
      **_LLAMA,
      parallel="data",
      devices=2,
      description="Llama-3 head, data parallel",
    ),
    Case(
      "llama_16k_vp",
      16384,
      **_LLAMA,
      parallel="vocab",
      devices=2,
      description="Llama-3 head, vocab parallel",
    ),
  ]
}
CASES.update((f"{n}_dv", _dv(CASES[n])) for n in ("gpt2", "gpt2_distill"))


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "blocks"))
def _normal(key, shape, dtype, scale, blocks=256):
  """Normal ``shape`` in ``dtype``, drawn ``blocks`` row blocks at a time.

  Only one block's float32 temporaries exist at once, so the device's peak
  memory while making a ``[V, D]`` weight is the weight plus a few MiB (a
  whole float32 draw would add ``4 V D`` bytes to the peak the benchmark
  measures).
  """
  rows = -(-shape[0] // blocks)

  def body(i, out):
    start = jnp.minimum(i * rows, shape[0] - rows)
    block = jax.random.normal(jax.random.fold_in(key, i), (rows, *shape[1:]))
    return jax.lax.dynamic_update_slice_in_dim(
      out, (block * scale).astype(dtype), start, 0
    )

  return jax.lax.fori_loop(0, -(-shape[0] // rows), body, jnp.zeros(shape, dtype))


def make_inputs(case: Case, seed: int = 0):
  """Random ``(hidden [N, D], weight [V, D] or [D, V], labels [N], where
  [N])``, then ``(teacher_hidden [N, D_t], teacher_weight)`` (in the weight's
  layout) for "distill"."""
  k_h, k_w, k_y, k_m, k_t = jax.random.split(jax.random.key(seed), 5)
  dtype = jnp.dtype(case.dtype)
  hidden = _normal(k_h, (case.tokens, case.dim), dtype, 1.0)
  weight = _normal(k_w, _weight_shape(case), dtype, 1.0 / np.sqrt(case.dim))
  labels = jax.random.randint(k_y, (case.tokens,), 0, case.vocab)
  if case.mask == "prefix":
    position = jnp.arange(case.tokens) % case.seq_len
    where = position >= int(case.masked_fraction * case.seq_len)
  elif case.mask == "random":
    where = jax.random.uniform(k_m, (case.tokens,)) >= case.masked_fraction
  else:
    where = jnp.ones((case.tokens,), bool)
  mesh = case.mesh
  if mesh is not None:
    rows = P("data") if case.parallel == "data" else P()
    vocab = P("model") if case.parallel == "vocab" else P()
    specs = (rows, vocab, rows, rows)
    hidden, weight, labels, where = (
      jax.device_put(x, NamedSharding(mesh, spec))
      for x, spec in zip((hidden, weight, labels, where), specs, strict=True)
    )
  if case.objective == "distill":
    if mesh is not None:
      raise Unsupported("distillation is benchmarked on one device only")
    k_th, k_tw = jax.random.split(k_t)
    dim = case.teacher_dim
    teacher_hidden = _normal(k_th, (case.tokens, dim), dtype, 1.0)
    teacher_weight = _normal(k_tw, _weight_shape(case, dim), dtype, 1.0 / np.sqrt(dim))
    return hidden, weight, labels, where, teacher_hidden, teacher_weight
  return hidden, weight, labels, where


def _weight_shape(case: Case, dim: int | None = None) -> tuple[int, int]:
  """A head's weight shape (``dim``: the teacher's, default the student's)."""
  dim = dim or case.dim
  return (dim, case.vocab) if case.weight_layout == "dv" else (case.vocab, dim)


def input_shapes(case: Case):
  """``jax.ShapeDtypeStruct`` s of ``make_inputs(case)`` (one device), to compile
  without allocating."""
  dtype = jnp.dtype(case.dtype)
  shapes = (
    jax.ShapeDtypeStruct((case.tokens, case.dim), dtype),
    jax.ShapeDtypeStruct(_weight_shape(case), dtype),
    jax.ShapeDtypeStruct((case.tokens,), jnp.int32),
    jax.ShapeDtypeStruct((case.tokens,), jnp.bool_),
  )
  if case.objective != "distill":
    return shapes
  teacher = (
    jax.ShapeDtypeStruct((case.tokens, case.teacher_dim), dtype),
    jax.ShapeDtypeStruct(_weight_shape(case, case.teacher_dim), dtype),
  )
  return shapes + teacher


class Unsupported(Exception):
  """This implementation cannot run this case (a missing peer, say)."""


def _naive_logits(hidden, weight, cast_logits: bool) -> jax.Array:
  """Full float32 logits: from a float32 matmul, or cast from the input dtype."""
  if cast_logits:
    return jnp.dot(hidden, weight.T).astype(jnp.float32)
  return jnp.dot(hidden, weight.T, preferred_element_type=jnp.float32)


def naive_loss(hidden, weight, labels, where, *, cast_logits=False):
  """The baseline: full ``[N, V]`` float32 logits, then a masked mean.

  With ``cast_logits`` the matmul returns logits in the input dtype and they
  are cast to float32 (what a Flax ``Dense(dtype=bfloat16)`` head followed by a
  float32 loss does): its backward runs its matmuls in the input dtype, where
  the float32-output version's autodiff promotes them to float32 (TF32 on a
  GPU). Ratios are taken against the faster of the two.
  """
  logits = _naive_logits(hidden, weight, cast_logits)
  lse = jax.nn.logsumexp(logits, axis=-1)
  target = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
  count = jnp.maximum(jnp.sum(where), 1)
  return jnp.sum(jnp.where(where, lse - target, 0.0)) / count


def _cotangents(n_tokens: int):
  """Two fixed, sign-changing ``[N]`` cotangents (cheap to form in the step)."""
  position = jnp.arange(n_tokens, dtype=jnp.float32)
  return jnp.sin(0.7 * position + 0.3), jnp.cos(1.3 * position)


def naive_log_probs(hidden, weight, labels, where, *, cast_logits=False):
  """The RL baseline: full float32 logits, ``log_softmax`` at the label and the
  entropy, summed against ``_cotangents``."""
  log_p = jax.nn.log_softmax(_naive_logits(hidden, weight, cast_logits), axis=-1)
  at_label = jnp.take_along_axis(log_p, labels[:, None], axis=-1)[:, 0]
  entropy = -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)
  g_lp, g_h = _cotangents(labels.shape[0])
  return jnp.sum(jnp.where(where, at_label * g_lp + entropy * g_h, 0.0))


def _mst_log_probs(hidden, weight, labels, where, **kwargs):
  log_probs, entropy = mst_jax.linear_log_probs(
    hidden, weight, labels, where=where, return_entropy=True, **kwargs
  )
  g_lp, g_h = _cotangents(labels.shape[0])
  return jnp.sum(log_probs * g_lp + entropy * g_h)


def naive_distill(
  hidden,
  weight,
  labels,
  where,
  teacher_hidden,
  teacher_weight,
  *,
  cast_logits=False,
):
  """The distillation baseline: both heads' full float32 logits, the forward
  KL ``sum P (log P - log Q)`` per token (the teacher not differentiated), a
  masked mean."""
  del labels
  log_q = jax.nn.log_softmax(_naive_logits(hidden, weight, cast_logits), axis=-1)
  teacher = _naive_logits(teacher_hidden, teacher_weight, cast_logits)
  log_p = jax.nn.log_softmax(jax.lax.stop_gradient(teacher), axis=-1)
  kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
  count = jnp.maximum(jnp.sum(where), 1)
  return jnp.sum(jnp.where(where, kl, 0.0)) / count


def _mst_distill(hidden, weight, labels, where, teacher_hidden, teacher_weight, **kw):
  """mst_jax's distillation loss; the labels only for a hard-label term
  (``mst_jax:hard_label_weight=0.5``)."""
  labels = labels if kw.get("hard_label_weight") else None
  return mst_jax.linear_distillation_loss(
    hidden, weight, teacher_hidden, teacher_weight, labels=labels, where=where, **kw
  )


def _parse_value(text: str):
  if text == "None":
    return None
  for parse in (int, float):
    try:
      return parse(text)
    except ValueError:
      pass
  return text


def parse_impl(spec: str) -> tuple[str, dict]:
  """``"mst_jax:grad_mode=recompute,chunk_size=1024"`` -> name and kwargs."""
  name, _, options = spec.partition(":")
  kwargs = {}
  for item in filter(None, options.split(",")):
    key, _, value = item.partition("=")
    kwargs[key] = _parse_value(value)
  return name, kwargs


def make_loss(spec: str, case: Case):
  """``loss(hidden, weight, labels, where)`` for an implementation spec."""
  name, kwargs = parse_impl(spec)
  log_probs = case.objective == "log_probs"
  distill = case.objective == "distill"
  dv = case.weight_layout == "dv"
  if dv and (log_probs or case.parallel):
    raise Unsupported(
      "a [D, V] weight is benchmarked on one device, for the cross-entropy and"
      " distillation"
    )
  if name in ("naive", "naive_cast"):
    baseline = {"log_probs": naive_log_probs, "distill": naive_distill}.get(
      case.objective, naive_loss
    )
    baseline = functools.partial(baseline, cast_logits=name == "naive_cast")
    if dv and distill:  # hidden @ kernel: XLA folds the transposes into the GEMMs
      return lambda h, kernel, y, where, h_t, kernel_t: baseline(
        h, kernel.T, y, where, h_t, kernel_t.T
      )
    if dv:
      return lambda hidden, kernel, *args: baseline(hidden, kernel.T, *args)
    return baseline
  if dv and name != "mst_jax":
    raise Unsupported(f"{name} is benchmarked with a [V, D] weight only")
  if name == "mst_jax":
    kwargs.update(case.mesh_axes)
    if dv:
      kwargs["weight_layout"] = "dv"
    if log_probs:
      return functools.partial(_mst_log_probs, **kwargs)
    if distill:
      return functools.partial(_mst_distill, **kwargs)

    def loss(hidden, weight, labels, where):
      return mst_jax.linear_cross_entropy(hidden, weight, labels, where=where, **kwargs)

    return loss
  if log_probs:
    raise Unsupported(f"{name} computes no per-token log-probabilities here")
  if distill:
    raise Unsupported(f"{name} computes no distillation loss")
  if case.parallel and name in ("jax_cce", "tokamax"):
    raise Unsupported(f"{name} is benchmarked on one device only")
  if case.mask != "none" and name in ("jax_cce", "tokamax"):
    raise Unsupported(f"{name} takes no token mask")
  if name == "jax_cce":
    try:
      import jax_cce
    except ImportError:
      raise Unsupported("jax_cce is not installed") from None
    return lambda h, w, y, where: jax_cce.linear_cross_entropy(h, w, y, **kwargs)
  if name == "tokamax":
    try:
      import tokamax
      from tokamax._src.ops.linear_softmax_cross_entropy_loss import api
    except ImportError:
      raise Unsupported("tokamax is not installed") from None
    if "chunked_xla" not in api.IMPLEMENTATIONS:
      raise Unsupported(
        f"the installed tokamax has no chunked_xla (has {sorted(api.IMPLEMENTATIONS)})"
      )
    return lambda h, w, y, where: tokamax.linear_softmax_cross_entropy_loss(
      h, y, w.T, reduction="mean", implementation="chunked_xla"
    )
  raise ValueError(f"unknown implementation {spec!r}")


def make_step(spec: str, case: Case):
  """The benchmarked step: jitted value-and-grad of ``spec``'s loss on ``case``."""
  return jax.jit(jax.value_and_grad(make_loss(spec, case), argnums=case.argnums))
