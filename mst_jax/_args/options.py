"""The options of the loss, declared once, and their checks.

``LossOptions`` say what is computed; ``PerfOptions`` say how (they change
the result only by rounding). ``linear_cross_entropy`` takes their fields as
keyword arguments (its ``jax.jit`` static names are built from them), the Flax
modules hold a ``HeadLossOptions`` (both at once), and the tests read the
field lists from here. Every check runs on Python values, at trace time.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import math
import operator
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from mst_jax import _manual_axes
from mst_jax._math.ce import CEOptions, at_least_float32

REDUCTIONS = ("mean", "sum", "none")
IMPLEMENTATIONS = (None, "xla", "pallas", "mosaic", "reference")
GRAD_MODES = (None, "fused", "recompute")


def _nearest_names(unknown, names) -> str:
  """``"; did you mean ...?"`` for each unknown keyword close to a valid one."""
  guesses = {
    name: difflib.get_close_matches(name, sorted(names), n=1, cutoff=0.6)
    for name in sorted(unknown)
  }
  found = [
    f"{name!r}: did you mean {close[0]!r}?" for name, close in guesses.items() if close
  ]
  return f" ({'; '.join(found)})" if found else ""


def public_jit(static_argnames, *, per_row_scale: bool = False):
  """``jax.jit`` for a public function, its options as ``static_argnames``.

  ``per_row_scale``: ``logit_scale`` may also be an array (a scale a
  position, traced or not), applied to ``hidden`` before the call
  (``_per_row_scale``).

  Python checks the arguments' names first, so a misspelt keyword raises the
  usual ``TypeError`` naming it (``jax.jit`` alone would try to read its value
  as an array). A concrete array scalar given for an option is taken as its
  Python value; a traced one raises ``TypeError``: options are static.
  The wrapper carries none of jit's attributes (``lower``, ``trace``):
  ``jax.grad``'s wrapper copies a function's ``__dict__``, so
  ``jax.jit(jax.grad(f)).lower`` would lower ``f`` alone.
  """

  def wrap(fn):
    jitted = jax.jit(fn, static_argnames=static_argnames)
    static = frozenset(static_argnames)
    signature = inspect.signature(fn)
    names = frozenset(signature.parameters)
    positional = [
      p for p in signature.parameters.values() if p.kind == p.POSITIONAL_OR_KEYWORD
    ]

    def well_formed(args, kwargs) -> bool:  # what bind checks, quicker
      given, rest = positional[: len(args)], positional[len(args) :]
      return (
        len(args) <= len(positional)
        and names.issuperset(kwargs)
        and not any(p.name in kwargs for p in given)
        and all(p.name in kwargs for p in rest if p.default is p.empty)
      )

    @functools.wraps(fn)
    def call(*args, **kwargs):
      if not well_formed(args, kwargs):
        try:
          signature.bind(*args, **kwargs)
        except TypeError as error:
          hint = _nearest_names(kwargs.keys() - names, names)
          raise TypeError(f"{fn.__name__}() {error}{hint}") from None
      if per_row_scale and _is_array_scale(kwargs.get("logit_scale")):
        bound = signature.bind(*args, **kwargs)
        args, kwargs = (), _per_row_scale(fn.__name__, dict(bound.arguments))
      for name in static & kwargs.keys():
        kwargs[name] = _static_value(name, kwargs[name])
      return jitted(*args, **kwargs)

    return call

  return wrap


def _is_array_scale(value) -> bool:
  """A ``logit_scale`` that is an array other than a concrete scalar."""
  if not isinstance(value, (jax.Array, np.ndarray, np.generic)):
    return False
  return np.ndim(value) > 0 or isinstance(value, jax.core.Tracer)


def _per_row_scale(name: str, arguments: dict) -> dict:
  """``arguments`` with an array ``logit_scale`` folded into ``hidden``.

  ``a * (hidden @ weight.T) = (a * hidden) @ weight.T`` for a scale ``a`` per
  position: ``hidden`` is scaled in float32 and rounded back to its dtype
  (one rounding of each element, for 16-bit inputs), and autodiff gives the
  scale its gradient. A bias would need scaling by position too: it raises.
  """
  hidden = jnp.asarray(arguments["hidden"])
  scale = jnp.asarray(arguments.pop("logit_scale"))
  if not jnp.issubdtype(scale.dtype, jnp.floating):
    raise TypeError(f"an array logit_scale must be floating, got {scale.dtype}.")
  try:
    scale = jnp.broadcast_to(scale, hidden.shape[:-1])
  except ValueError:
    raise ValueError(
      f"an array logit_scale must broadcast to hidden's leading shape"
      f" {hidden.shape[:-1]} (one scale a position), got {scale.shape}."
    ) from None
  if arguments.get("bias") is not None:
    raise NotImplementedError(
      f"{name}: a logit_scale per position with a bias is not supported; pass"
      " a Python float logit_scale, or fold the bias into the weight."
    )
  wide = jnp.promote_types(hidden.dtype, jnp.float32)
  scaled = hidden.astype(wide) * scale.astype(wide)[..., None]
  return {**arguments, "hidden": scaled.astype(hidden.dtype)}


def _static_value(name: str, value):
  if not isinstance(value, (jax.Array, np.ndarray, np.generic)):
    return value
  try:
    if np.ndim(value) == 0:
      return value.item()
  except jax.errors.ConcretizationTypeError:
    pass
  raise TypeError(
    f"{name} is a static option: pass a Python value, not an array ({value!r})."
  )


# Names users bring from other libraries, and the choice that means them.
_CHOICE_HINTS = {
  ("impl", "triton"): " (the Pallas Triton kernels are impl='pallas')",
  ("impl", "cuda"): " (impl=None picks the GPU kernels)",
  ("impl", "gpu"): " (impl=None picks the GPU kernels)",
}


def check_choice(name: str, value, choices) -> None:
  if value not in choices:
    hint = _CHOICE_HINTS.get((name, value), "") if isinstance(value, str) else ""
    raise ValueError(f"{name} must be one of {choices}, got {value!r}{hint}.")


def check_int(name: str, value, *, minimum: int | None = None) -> int:
  """Returns ``value`` as a Python int, or raises ``TypeError``/``ValueError``."""
  if isinstance(value, bool):
    raise TypeError(f"{name} must be an int, got {value!r}.")
  try:
    value = operator.index(value)
  except TypeError:
    raise TypeError(f"{name} must be an int, got {value!r}.") from None
  if minimum is not None and value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value}.")
  return value


def check_finite_float(name: str, value) -> float:
  """Returns ``value`` as a finite Python float, or raises."""
  if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
    raise TypeError(f"{name} must be a Python float, got {value!r}.")
  value = float(value)
  if not math.isfinite(value):
    raise ValueError(f"{name} must be finite, got {value!r}.")
  return value


def as_dtype(name: str, dtype) -> np.dtype | None:
  """``dtype`` as a floating ``np.dtype`` (None stays None), or raises ``TypeError``."""
  if dtype is None:
    return None
  try:
    dtype = np.dtype(dtype)
  except TypeError:
    raise TypeError(f"{name} must be a dtype, got {dtype!r}.") from None
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{name} must be a floating dtype, got {dtype}.")
  return dtype


def _replace_field(options, name: str, value) -> None:
  object.__setattr__(options, name, value)  # normalising a frozen dataclass


@dataclasses.dataclass(frozen=True)
class LossOptions:
  """What the loss is: the options that define its value.

  See ``mst_jax.linear_cross_entropy`` for each. Values are checked and
  normalised (ints and floats as Python numbers) on construction.
  """

  ignore_index: int = -100
  reduction: str = "mean"
  label_smoothing: float = 0.0
  z_loss: float = 0.0
  logit_softcap: float | None = None
  logit_scale: float | None = None
  shift: bool = False

  def __post_init__(self) -> None:
    check_choice("reduction", self.reduction, REDUCTIONS)
    _replace_field(self, "ignore_index", check_int("ignore_index", self.ignore_index))
    if not isinstance(self.shift, bool):
      raise TypeError(f"shift must be a bool, got {self.shift!r}.")
    for name in ("label_smoothing", "z_loss"):
      _replace_field(self, name, check_finite_float(name, getattr(self, name)))
    for name in ("logit_softcap", "logit_scale"):
      if getattr(self, name) is not None:
        _replace_field(self, name, check_finite_float(name, getattr(self, name)))
    self.ce  # noqa: B018 -- CEOptions checks the ranges

  @property
  def ce(self) -> CEOptions:
    """The per-row options the kernels see."""
    scale = 1.0 if self.logit_scale is None else self.logit_scale
    return CEOptions(self.label_smoothing, self.z_loss, self.logit_softcap, scale)


@dataclasses.dataclass(frozen=True)
class PerfOptions:
  """How the loss is computed: chunking, backend, dtypes, gradient mode.

  See ``mst_jax.linear_cross_entropy`` for each. None means "choose"
  (``mst_jax._losses.cross_entropy.resolve`` decides, in one place).
  """

  chunk_size: int | None = None
  memory_budget: int | None = None
  vocab_block_size: int | None = None
  impl: str | None = None
  accum_dtype: jax.typing.DTypeLike | None = None
  logits_dtype: jax.typing.DTypeLike | None = None
  grad_mode: str | None = None

  def __post_init__(self) -> None:
    check_choice("impl", self.impl, IMPLEMENTATIONS)
    if self.memory_budget is not None:
      _replace_field(self, "memory_budget", _bytes(self.memory_budget))
    for name in ("chunk_size", "memory_budget", "vocab_block_size"):
      if getattr(self, name) is not None:
        _replace_field(self, name, check_int(name, getattr(self, name), minimum=1))
    if self.chunk_size is not None and self.memory_budget is not None:
      raise ValueError("give chunk_size or memory_budget, not both.")
    for name in ("accum_dtype", "logits_dtype"):
      _replace_field(self, name, as_dtype(name, getattr(self, name)))
    check_choice("grad_mode", self.grad_mode, GRAD_MODES)
    chunked_only = [f.name for f in dataclasses.fields(PerfOptions)]
    chunked_only.remove("impl")
    if self.impl == "reference" and any(
      getattr(self, n) is not None for n in chunked_only
    ):
      raise ValueError(
        f"{', '.join(chunked_only[:-1])} and {chunked_only[-1]} apply to the"
        " chunked implementations, not impl='reference' (which forms the full"
        " logits)."
      )


def _bytes(value):
  """A ``memory_budget``: an int as it is (``check_int`` checks it), a float
  with a whole value (``1e9``) as that int, else ``TypeError``."""
  try:
    return operator.index(value)
  except TypeError:
    pass
  try:
    number = float(value)
  except (TypeError, ValueError):
    number = math.nan
  if not number.is_integer():
    raise TypeError(
      f"memory_budget must be a number of bytes (1 << 30 for 1 GiB), got {value!r}."
    )
  return int(number)


def for_manual_axes(perf: PerfOptions, x: jax.Array) -> PerfOptions:
  """``perf`` for inputs like ``x``: inside a caller's ``jax.shard_map`` that
  checks manual axes (``check_vma=True``), where every output must carry
  the axes it varies over, the XLA backend (the Pallas and Mosaic kernels'
  outputs carry none); elsewhere ``perf`` itself."""
  axes = _manual_axes.axes(x)
  if not axes or perf.impl in ("xla", "reference"):
    return perf
  if perf.impl is not None:
    raise ValueError(
      f"impl={perf.impl!r} cannot run inside a jax.shard_map with"
      f" check_vma=True (the inputs vary over the mesh axes {sorted(axes, key=str)}):"
      " its kernels' outputs carry no manual axes. Pass check_vma=False to"
      " jax.shard_map, or impl=None (which runs XLA's backend there)."
    )
  return dataclasses.replace(perf, impl="xla")


def check_combination(loss: LossOptions, perf: PerfOptions) -> None:
  """Raises for valid options that do not work together."""
  if perf.grad_mode == "fused" and loss.reduction == "none":
    raise NotImplementedError(
      "grad_mode='fused' forms the gradient of a scalar loss during the forward"
      " pass; reduction='none' needs grad_mode='recompute' (or None)."
    )


def _pick(cls, values: Mapping):
  return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls)})


def from_arguments(arguments: Mapping) -> tuple[LossOptions, PerfOptions]:
  """The checked options among a function's arguments (e.g. its ``locals()``)."""
  perf = _pick(PerfOptions, arguments)
  loss = _pick(LossOptions, arguments)
  check_combination(loss, perf)
  return loss, perf


@dataclasses.dataclass(frozen=True)
class HeadLossOptions(PerfOptions, LossOptions):
  """Every option of ``linear_cross_entropy``, as a Flax head fixes them.

  The fields of ``LossOptions``, then those of ``PerfOptions``; checked and
  normalised on construction, so a bad value (or combination) fails when the
  module is built rather than at its first call.
  """

  def __post_init__(self) -> None:
    for options in from_arguments(dataclasses.asdict(self)):
      for field in dataclasses.fields(options):
        _replace_field(self, field.name, getattr(options, field.name))


# linear_cross_entropy's options, in the order its signature declares them.
OPTION_NAMES = tuple(f.name for f in dataclasses.fields(LossOptions)) + tuple(
  f.name for f in dataclasses.fields(PerfOptions)
)


def head_options(owner: str, options: Mapping, also=()) -> HeadLossOptions:
  """A Flax head's ``HeadLossOptions`` from its keywords; an unknown one
  raises ``TypeError`` naming ``owner`` and the options it takes (``also``:
  its other keywords, to list beside them)."""
  names = [f.name for f in dataclasses.fields(HeadLossOptions)]
  unknown = sorted(set(options) - set(names))
  if unknown:
    others = f", besides {list(also)}" if also else ""
    hint = _nearest_names(unknown, [*names, *also])
    raise TypeError(
      f"{owner} got unexpected keyword argument(s) {unknown}{hint}; its loss"
      f" options are {names}{others}."
    )
  return HeadLossOptions(**options)


def resolve_logits_dtype(requested: np.dtype | None, dtype: np.dtype) -> np.dtype:
  """``logits_dtype`` decided: bfloat16 logits for bfloat16 inputs (as a
  bfloat16 ``Dense`` head has), else at least float32; never wider than the
  loss's float32 (float64)."""
  widest = at_least_float32(dtype)
  logits_dtype = np.dtype(requested or (dtype if dtype == jnp.bfloat16 else widest))
  if logits_dtype.itemsize > widest.itemsize:
    raise ValueError(
      f"logits_dtype={logits_dtype} is wider than the {widest} the loss is"
      f" computed in for {dtype} inputs; pass float64 inputs for"
      " float64 logits."
    )
  return logits_dtype
