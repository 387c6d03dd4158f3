"""The package's structure: layers, no import cycles, options declared once.

docs/architecture.md describes the layers; ``LAYERS`` below is the same list.
A module may import only modules of earlier layers (or, inside a package
layer such as ``_kernels``, its own package's modules), counting imports
inside functions.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib
import re
import subprocess
import sys

import pytest

import mst_jax

PACKAGE = pathlib.Path(mst_jax.__file__).resolve().parent
ROOT = PACKAGE.parent

LAYERS = [
  [
    "mst_jax._math",
    "mst_jax._math.ce",
    "mst_jax._math.online",
    "mst_jax._plan",
    "mst_jax._math.distill",
    "mst_jax._gemm.mosaic",
    "mst_jax._gemm.mosaic.config",
    "mst_jax._manual_axes",
  ],  # math, heuristics, manual mesh axes
  ["mst_jax._gemm.mosaic.epilogue"],  # the Mosaic GPU GEMM's epilogues
  ["mst_jax._gemm.mosaic.kernels"],  # the Mosaic GPU GEMM kernels
  ["mst_jax._gemm.mosaic.gemm"],  # their arguments and config
  [
    "mst_jax._args",
    "mst_jax._args.options",
    "mst_jax._gemm",
    "mst_jax._gemm.matmul",
    "mst_jax._math.full_logits",
    "mst_jax._math.full_distill",
  ],
  ["mst_jax._args.inputs"],
  ["mst_jax._kernels*"],  # per-chunk backends
  ["mst_jax._sweep", "mst_jax._sweep.rows"],  # shared row helpers
  ["mst_jax._sweep.gradients"],  # row-chunked gradient strategies
  ["mst_jax._sweep.row_chunks", "mst_jax._sweep.vocab_blocks"],  # loop orders, peers
  ["mst_jax._sweep.driver", "mst_jax._sweep.distill_driver"],  # custom VJPs
  ["mst_jax._sweep.mesh"],
  ["mst_jax._losses", "mst_jax._losses.cross_entropy"],
  ["mst_jax._losses.log_probs"],  # a second public function on the same machinery
  ["mst_jax._losses.distillation"],  # the distillation loss
  ["mst_jax.reference"],
  ["mst_jax._flax_head"],
  ["mst_jax.linen", "mst_jax.nnx"],
  ["mst_jax"],  # the public surface
  ["mst_jax.bench*"],
]


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: pathlib.Path) -> set[str]:
  """The ``mst_jax`` modules a file imports, anywhere in it."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names if a.name.split(".")[0] == "mst_jax")
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mst_jax"):
      for alias in node.names:
        name = f"{node.module}.{alias.name}"
        found.add(name if name in MODULES else node.module)
  return found


GRAPH = {name: _imports(path) for name, path in MODULES.items()}


def _layer(module: str) -> int:
  for index, group in enumerate(LAYERS):
    for pattern in group:
      if module == pattern or (
        pattern.endswith("*") and module.startswith(pattern[:-1])
      ):
        return index
  raise AssertionError(f"{module} is in no layer of LAYERS (add it)")


def test_every_module_has_a_layer():
  for module in MODULES:
    _layer(module)


def test_no_import_cycles():
  state = {}

  def visit(module, path):
    state[module] = "open"
    for target in sorted(GRAPH.get(module, ())):
      if state.get(target) == "open":
        cycle = path[path.index(target) :] + [target]
        raise AssertionError("import cycle: " + " -> ".join(cycle))
      if target not in state:
        visit(target, path + [target])
    state[module] = "done"

  for module in MODULES:
    if module not in state:
      visit(module, [module])


def test_no_module_imports_a_higher_layer():
  upward = []
  for module, targets in GRAPH.items():
    for target in targets:
      same_package = target.split(".")[:2] == module.split(".")[:2]
      lower = _layer(target) < _layer(module)
      if not lower and not (_layer(target) == _layer(module) and same_package):
        upward.append(f"{module} imports {target}")
  assert not upward, upward


def test_private_modules_are_prefixed():
  public = {"mst_jax", "mst_jax.reference", "mst_jax.linen", "mst_jax.nnx"}
  for module in MODULES:
    if module.startswith("mst_jax.bench"):
      continue  # the benchmark CLI, run as python -m mst_jax.bench
    private = any(part.startswith("_") for part in module.split(".")[1:])
    assert module in public or private, module


# Each word's first letter in brackets, so that this file does not match itself.
_HISTORY = re.compile(
  r"\b([s]essions?|issues? #?[0-9]+|runs? [0-9]+(-[0-9]+)?|[r]everted|[n]ot adopted"
  r"|[t]he issue'?s?)\b",
  re.I,
)


def _current_texts() -> list[pathlib.Path]:
  """Docs, scripts, tools, examples and tests: each describes the software as
  it is (figures in docs/benchmarks.md with their GPU, date and commit)."""
  paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
  for folder in ("scripts", "tools", "examples", "tests"):
    paths += sorted(
      p
      for p in (ROOT / folder).rglob("*")
      if p.suffix in (".py", ".sh", ".md") and "__pycache__" not in p.parts
    )
  return paths


@pytest.mark.parametrize(
  "path",
  [*_current_texts(), *MODULES.values()],
  ids=lambda p: str(p.relative_to(ROOT)),
)
def test_no_development_history(path):
  """No narration of how the work went (work periods, issue or run numbers,
  what was tried and dropped) anywhere: that history lives in git."""
  if not path.exists():
    pytest.skip(f"{path.name} is not beside an installed package")
  hits = [m.group(0) for m in _HISTORY.finditer(path.read_text())]
  assert not hits, hits


def test_importing_mst_jax_does_not_import_flax():
  code = "import sys, mst_jax; print('flax' in sys.modules)"
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, check=True
  )
  assert out.stdout.strip() == "False", out.stdout + out.stderr
  assert mst_jax.LMHeadLoss is mst_jax.nnx.LMHeadLoss


def test_options_are_declared_once():
  """The function's option keywords are the dataclasses' fields, same defaults."""
  signature = inspect.signature(mst_jax.linear_cross_entropy)
  fields = [
    *dataclasses.fields(mst_jax.LossOptions),
    *dataclasses.fields(mst_jax.PerfOptions),
  ]
  for field in fields:
    assert signature.parameters[field.name].default == field.default, field.name
  head_fields = {f.name for f in dataclasses.fields(mst_jax.HeadLossOptions)}
  assert head_fields == {f.name for f in fields}


def test_the_gpu_check_script_runs_every_gpu_test_file():
  """``tools/gpu_check.sh``'s parts ``gpu_a``, ``gpu_b`` and ``gpu_c`` name
  every test file with a ``gpu`` mark, so the three parts run the whole
  GPU suite."""
  script = (ROOT / "tools" / "gpu_check.sh").read_text()
  parts = script.split("    gpu_a)")[1].split("    suite)")[0]
  named = set(re.findall(r"tests/(test_\w+\.py)", parts))
  marked = {
    p.name
    for p in (ROOT / "tests").glob("test_*.py")
    if re.search(r"^\s*@pytest\.mark\.gpu\b", p.read_text(), re.M)
  }
  assert marked and marked == named, (marked - named, named - marked)
