"""Errors that say what to do: the valid keyword nearest a misspelt one, the
``impl`` that means Triton, ``shift=True`` for already-shifted labels."""

from __future__ import annotations

import subprocess
import sys

import jax.numpy as jnp
import pytest

import mst_jax

H, W, Y = jnp.ones((2, 5, 8)), jnp.ones((10, 8)), jnp.zeros((2, 5), jnp.int32)


def _call(name, **kwargs):
  if name == "linear_distillation_loss":
    return mst_jax.linear_distillation_loss(H, W, H, W, Y, **kwargs)
  return getattr(mst_jax, name)(H, W, Y, **kwargs)


@pytest.mark.parametrize(
  "name,typo,meant",
  [
    ("linear_cross_entropy", "ignore_idx", "ignore_index"),
    ("linear_cross_entropy", "label_smooting", "label_smoothing"),
    ("linear_log_probs", "return_entropies", "return_entropy"),
    ("linear_distillation_loss", "temprature", "temperature"),
  ],
)
def test_a_misspelt_keyword_names_the_nearest_one(name, typo, meant):
  with pytest.raises(TypeError, match=f"'{typo}': did you mean '{meant}'"):
    _call(name, **{typo: 1})


def test_a_keyword_far_from_every_option_gets_no_guess():
  with pytest.raises(TypeError, match="unexpected keyword") as error:
    mst_jax.linear_log_probs(H, W, Y, reduction="sum")
  assert "did you mean" not in str(error.value)


def test_the_flax_head_names_the_nearest_option():
  pytest.importorskip("flax")
  from mst_jax._args import options as _options

  with pytest.raises(TypeError, match="'ignore_idx': did you mean 'ignore_index'"):
    _options.head_options("LMHeadLoss", {"ignore_idx": 1})


def test_impl_triton_points_at_pallas():
  with pytest.raises(ValueError, match="impl='pallas'"):
    mst_jax.linear_cross_entropy(H, W, Y, impl="triton")


@pytest.mark.parametrize("name", ["linear_cross_entropy", "linear_log_probs"])
def test_labels_one_position_short_suggest_shift(name):
  with pytest.raises(ValueError, match="shift=True"):
    getattr(mst_jax, name)(H, W, Y[:, 1:])
  with pytest.raises(ValueError) as error:  # another mismatch: no such hint
    getattr(mst_jax, name)(H, W, Y[:1])
  assert "shift=True" not in str(error.value)


@pytest.mark.parametrize("module", ["nnx", "linen", "LMHeadLoss"])
def test_the_flax_modules_without_flax_name_the_extra(module):
  """Flax is an extra: without it, ``import mst_jax`` works and the Flax
  modules' ImportError says how to install it (a fresh process, in which
  importing Flax fails)."""
  code = (
    "import sys; sys.modules['flax'] = None\n"
    "import mst_jax\n"
    "try:\n"
    f"  getattr(mst_jax, {module!r})\n"
    "except ImportError as e:\n"
    "  print('ImportError:', e)\n"
  )
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, check=True
  ).stdout
  assert "pip install 'mst_jax[flax]'" in out, out
