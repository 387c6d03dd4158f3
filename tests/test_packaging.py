"""The wheel: every module, py.typed and the license in it, its metadata right.

The wheel is built offline (``pip wheel --no-build-isolation --no-index``) from
a copy of the files a build reads, so the test leaves the work tree alone.
"""

from __future__ import annotations

import email
import importlib.metadata
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

import mst_jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mst_jax"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# Besides the package itself, what setuptools reads to build the wheel.
BUILD_INPUTS = ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in")


def _missing_build_requirement() -> str | None:
  """The first build requirement not installed here, or None."""
  for line in PYPROJECT["build-system"]["requires"]:
    requirement = Requirement(line)
    try:
      version = importlib.metadata.version(requirement.name)
    except importlib.metadata.PackageNotFoundError:
      return line
    if not requirement.specifier.contains(version, prereleases=True):
      return f"{line} (found {version})"
  return None


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
  missing = _missing_build_requirement()
  if missing:
    pytest.skip(
      f"building the wheel without isolation needs {missing}: "
      'pip install -e ".[test]" installs it'
    )
  source = tmp_path_factory.mktemp("source")
  for name in BUILD_INPUTS:
    shutil.copy(ROOT / name, source / name)
  shutil.copytree(
    PACKAGE, source / "mst_jax", ignore=shutil.ignore_patterns("__pycache__")
  )
  out = tmp_path_factory.mktemp("wheel")
  command = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps"]
  command += ["--no-build-isolation", "--no-index", "-q", "-w", str(out)]
  result = subprocess.run(
    command,
    capture_output=True,
    text=True,
    timeout=120,
    env=os.environ | {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"},
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  (path,) = out.glob("*.whl")
  version = PYPROJECT["project"]["version"]
  assert path.name == f"mst_jax-{version}-py3-none-any.whl"
  return zipfile.ZipFile(path)


def _metadata(wheel: zipfile.ZipFile) -> email.message.Message:
  (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
  return email.message_from_bytes(wheel.read(name))


def test_wheel_holds_every_module_and_py_typed(wheel):
  modules = {
    path.relative_to(ROOT).as_posix()
    for path in PACKAGE.rglob("*.py")
    if "__pycache__" not in path.parts
  }
  in_wheel = {name for name in wheel.namelist() if name.startswith("mst_jax/")}
  assert "mst_jax/bench/cli.py" in modules  # the walk found the subpackages
  assert modules - in_wheel == set()
  assert in_wheel - modules == {"mst_jax/py.typed"}


def test_wheel_holds_the_license(wheel):
  licenses = [n for n in wheel.namelist() if re.search(r"\.dist-info/.*LICENSE$", n)]
  assert len(licenses) == 1, wheel.namelist()
  text = wheel.read(licenses[0]).decode()
  assert text == (ROOT / "LICENSE").read_text()
  assert "Apache License" in text and "Version 2.0, January 2004" in text
  assert _metadata(wheel)["License-Expression"] == PYPROJECT["project"]["license"]


def test_versions_agree(wheel):
  assert mst_jax.__version__ == PYPROJECT["project"]["version"]
  assert _metadata(wheel)["Version"] == mst_jax.__version__


def test_metadata_states_the_pythons_and_the_gpu_extras(wheel):
  metadata = _metadata(wheel)
  requires_python = SpecifierSet(metadata["Requires-Python"])
  pythons = [
    c.rsplit(" :: ", 1)[1]
    for c in metadata.get_all("Classifier")
    if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
  ]
  running = f"{sys.version_info.major}.{sys.version_info.minor}"
  assert running in pythons, f"the tests run on Python {running}, not in {pythons}"
  assert all(requires_python.contains(f"{p}.0") for p in pythons), pythons
  extras = metadata.get_all("Provides-Extra")
  assert {"test", "examples", "cuda12", "cuda13"} <= set(extras), extras
  # The GPU extras ask for the same jax as the core dependency.
  jax_pins = [Requirement(r) for r in metadata.get_all("Requires-Dist")]
  jax_pins = [r for r in jax_pins if r.name == "jax"]
  (core,) = [r for r in jax_pins if r.marker is None]
  gpu = [r for r in jax_pins if r.extras & {"cuda12", "cuda13"}]
  assert len(gpu) == 2 and all(r.specifier == core.specifier for r in gpu), gpu
