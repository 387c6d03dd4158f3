"""Which path the default takes on which jax: the Mosaic GPU kernels on a
Hopper GPU, with tiles whose accumulators fit the registers that jaxlib's PTX
compilation leaves them (from jaxlib 0.12: cooperative 128 x 128 tiles, and
the statistics outside the logits GEMM), and XLA's per-chunk math (not
Triton's) behind them (checked on any host by faking the device and the
version)."""

from __future__ import annotations

import jax
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


@pytest.mark.parametrize("version", ["0.11.2", "0.12.0.1"])
def test_the_default_on_hopper_is_mosaic_on_every_jaxlib(monkeypatch, version):
  """impl=None and impl="mosaic": the Mosaic kernels, XLA's chunk behind
  them (never Triton's); impl="pallas": Triton's."""
  monkeypatch.setattr(mosaic_gemm, "unavailable_reason", lambda: None)
  monkeypatch.setattr(_kernels, "pallas_unavailable_reason", lambda platform: None)
  monkeypatch.setattr(jaxlib, "__version__", version)
  for impl in (None, "mosaic"):
    assert _kernels.select_gemm(impl, "gpu") == "mosaic"
    ce = _kernels.select(impl, "gpu")
    assert type(ce).__name__ == "MosaicChunkCE"
    # What the Mosaic kernels do not take runs on XLA, not Triton.
    assert type(ce.fallback()).__name__ == "XlaChunkCE"
    distill = _kernels.select_distill(impl, "gpu")
    assert type(distill).__name__ == "MosaicDistill"
    assert type(distill.fallback()).__name__ == "XlaDistill"  # XLA's chunk
  assert type(_kernels.select("pallas", "gpu")).__name__ == "PallasTritonChunkCE"


@pytest.mark.parametrize("version,fused", [("0.11.2", True), ("0.12.0.1", False)])
def test_the_logits_gemm_fuses_the_statistics_before_jaxlib_0_12(
  monkeypatch, version, fused
):
  """The Llama-3 head's logits: one ping-pong GEMM with the statistics
  epilogue (128 x 192 tiles) before jaxlib 0.12; from it, a cooperative GEMM
  of 128 x 128 tiles and no epilogue (``mosaic_logits`` returns None, so the
  statistics kernel reads the logits)."""
  from mst_jax._gemm import matmul
  from mst_jax._kernels.mosaic import stats as mosaic_stats
  from mst_jax._math.ce import CEOptions

  monkeypatch.setattr(mosaic_gemm, "unavailable_reason", lambda: None)
  monkeypatch.setattr(jaxlib, "__version__", version)
  assert mosaic_gemm.fuses_row_epilogues() is fused
  hidden = jax.ShapeDtypeStruct((1000, 4096), jnp.bfloat16)
  weight = jax.ShapeDtypeStruct((128256, 4096), jnp.bfloat16)
  labels = jax.ShapeDtypeStruct((1000,), jnp.int32)
  epilogue = mosaic_stats.TileStats(CEOptions(), 128256)
  calls = []
  fake = lambda *args, **kwargs: calls.append(kwargs) or (None, None)
  monkeypatch.setattr(mosaic_gemm, "matmul", fake)
  out = matmul.mosaic_logits(hidden, weight, "vd", jnp.bfloat16, epilogue, (labels,))
  assert (out is not None) is fused
  assert len(calls) == fused
  dims = (((1,), (1,)), ((), ()))
  plain = mosaic_gemm._config(
    mosaic_gemm._check(hidden, weight, dims, jnp.bfloat16, None)
  )
  if fused:
    assert calls[0]["config"].split == "tiles"
    assert (plain.split, plain.tile_m, plain.tile_n) == ("tiles", 128, 192)
  else:
    assert (plain.split, plain.tile_m, plain.tile_n) == ("m", 128, 128)


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
        # A row epilogue runs ping-pong; other narrowed tiles cooperate.
        assert (c.split == "tiles") >= (vectors is not None)
        assert c.smem_bytes(bf16, out, acc, vectors or 0) <= SMEM_BYTES
