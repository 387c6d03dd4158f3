"""Which path the default takes on which jax: the Mosaic GPU kernels on a
Hopper GPU (before jaxlib 0.12), with tiles whose accumulators fit the
registers that jaxlib's PTX compilation leaves them, and XLA's per-chunk math
(not Triton's) behind them (checked on any host by faking the device and the
version)."""

from __future__ import annotations

import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest

from mst_jax import _kernels
from mst_jax._gemm.mosaic import gemm as mosaic_gemm
from mst_jax._gemm.mosaic.config import SMEM_BYTES, accumulator_limit, default_config


@pytest.mark.parametrize(
  "version,limit",
  [
    ("0.10.2", 128 * 192),
    ("0.11.2", 128 * 192),
    ("0.12.0", 128 * 128),
    ("0.12.0.1", 128 * 128),
    ("1.0", 128 * 128),
  ],
)
def test_accumulator_limit_from_jaxlib_0_12(version, limit):
  assert accumulator_limit(version) == limit


@pytest.mark.parametrize(
  "version,slow",
  [
    ("0.10.2", False),
    ("0.11.2", False),
    ("0.12.0", True),
    ("0.12.0.1", True),
    ("1.0", True),
  ],
)
def test_mosaic_is_slow_from_jaxlib_0_12(version, slow):
  assert _kernels.mosaic_is_slow(version) is slow


@pytest.mark.parametrize("version", ["0.11.2", "0.12.0.1"])
def test_the_default_on_hopper_follows_the_jaxlib_version(monkeypatch, version):
  """impl=None: the Mosaic kernels, or from jaxlib 0.12 the Triton ones;
  impl="mosaic": the Mosaic kernels on either."""
  monkeypatch.setattr(mosaic_gemm, "unavailable_reason", lambda: None)
  monkeypatch.setattr(_kernels, "pallas_unavailable_reason", lambda platform: None)
  monkeypatch.setattr(jaxlib, "__version__", version)
  if _kernels.mosaic_is_slow(version):
    assert _kernels.select_gemm(None, "gpu") == "xla"
    assert type(_kernels.select(None, "gpu")).__name__ == "PallasTritonChunkCE"
    assert type(_kernels.select_distill(None, "gpu")).__name__ == "PallasTritonDistill"
  for impl in (None, "mosaic") if not _kernels.mosaic_is_slow(version) else ("mosaic",):
    assert _kernels.select_gemm(impl, "gpu") == "mosaic"
    ce = _kernels.select(impl, "gpu")
    assert type(ce).__name__ == "MosaicChunkCE"
    # What the Mosaic kernels do not take runs on XLA, not Triton.
    assert type(ce.fallback()).__name__ == "XlaChunkCE"
    distill = _kernels.select_distill(impl, "gpu")
    assert type(distill).__name__ == "MosaicDistill"
    assert type(distill.fallback()).__name__ == "XlaDistill"  # XLA's chunk
  assert type(_kernels.select("pallas", "gpu")).__name__ == "PallasTritonChunkCE"


def _shapes(rng: np.random.Generator, count: int):
  """Random head shapes (rows, D, V) with Mosaic-copyable widths."""
  for _ in range(count):
    rows = int(rng.integers(1, 64)) * 64
    d = int(rng.integers(1, 80)) * 64
    v = int(rng.integers(1, 4000)) * 64
    yield rows, d, v


@pytest.mark.parametrize("version", ["0.11.2", "0.12.0.1"])
def test_every_default_tile_fits_the_jaxlib_registers(monkeypatch, rng, version):
  """Every product of a head's step (logits with and without a row
  epilogue, dhidden, dweight accumulated or not, both output dtypes) holds
  at most the jaxlib's accumulator limit a warpgroup, and fits shared
  memory."""
  monkeypatch.setattr(jaxlib, "__version__", version)
  limit = mosaic_gemm._accumulator()
  assert limit == accumulator_limit(version)
  bf16, f32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
  for rows, d, v in _shapes(rng, 40):
    for m, n, k, acc, vectors in [
      (rows, v, d, False, None),
      (rows, v, d, False, 4),
      (rows, d, v, False, None),
      (v, d, rows, True, None),
      (v, d, rows, False, None),
    ]:
      for out in (bf16, f32):
        c = default_config(m, n, k, out, acc, 132, vectors, limit)
        assert c.tile_m * c.tile_n <= limit, (m, n, k, acc, vectors, c)
        assert c.smem_bytes(bf16, out, acc, vectors or 0) <= SMEM_BYTES
