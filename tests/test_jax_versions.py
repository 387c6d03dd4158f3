"""Which path the default takes on which jax: the Mosaic GPU GEMMs on a Hopper
GPU, except under a jaxlib that compiles them slowly (checked on any host
by faking the device and the version)."""

from __future__ import annotations

import jaxlib
import pytest

from mst_jax import _backends, _mosaic_gemm
from mst_jax._backends import mosaic_is_slow


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
  assert mosaic_is_slow(version) is slow


@pytest.mark.parametrize("version", ["0.11.2", "0.12.0.1"])
def test_the_default_on_hopper_follows_the_jaxlib_version(monkeypatch, version):
  monkeypatch.setattr(_mosaic_gemm, "unavailable_reason", lambda: None)
  monkeypatch.setattr(_backends, "pallas_unavailable_reason", lambda platform: None)
  monkeypatch.setattr(jaxlib, "__version__", version)
  fast = not mosaic_is_slow(version)
  assert _backends.select_gemm(None, "gpu") == ("mosaic" if fast else "xla")
  default = type(_backends.select(None, "gpu")).__name__
  assert default == ("MosaicChunkCE" if fast else "PallasTritonChunkCE")
  distill = type(_backends.select_distill(None, "gpu")).__name__
  assert distill == ("MosaicDistill" if fast else "PallasTritonDistill")
  # Asked for by name, the Mosaic kernels run on either version.
  assert _backends.select_gemm("mosaic", "gpu") == "mosaic"
  assert type(_backends.select("mosaic", "gpu")).__name__ == "MosaicChunkCE"
