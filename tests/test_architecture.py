"""The package's structure: layers, no import cycles, options declared once.

``LAYERS`` lists ``mst_jax``'s top-level folders and modules from the ground
up, as docs/architecture.md's picture does (a test holds the two together). A
module may import modules of earlier layers and of its own folder, never a
later layer or a peer of its own layer, counting imports inside functions; no
imports go in a circle.
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

# The top-level folders and modules of mst_jax, from the ground up; peers
# share a layer. "__init__" is mst_jax/__init__.py.
LAYERS = [
  ["_math", "_manual_axes"],  # per-row math; values in a caller's shard_map
  ["_gemm"],  # the head's three products (XLA, the Mosaic GPU GEMM)
  ["_kernels"],  # one chunk's scores, behind one interface; the selection
  ["_plan"],  # rows per chunk for a memory budget
  ["_args"],  # the options, declared once; inputs in, outputs out
  ["_sweep"],  # the loop orders, their custom VJPs, the mesh
  ["_losses"],  # the public functions' implementations
  [
    "reference",
    "_flax_head",
    "losses",
  ],  # the oracle; the Flax modules' base; log-prob losses
  ["linen", "nnx"],  # the Flax modules
  ["__init__"],  # the public surface
  ["bench"],  # the benchmark CLI
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


def _unit(module: str) -> str:
  """The top-level folder or module of mst_jax that ``module`` is in."""
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else "__init__"


def _layer(module: str) -> int:
  unit = _unit(module)
  for index, group in enumerate(LAYERS):
    if unit in group:
      return index
  raise AssertionError(f"{unit} ({module}) is in no layer of LAYERS (add it)")


def _unit_graph() -> dict[str, set[str]]:
  """Which top-level folders and modules import which."""
  graph = {_unit(module): set() for module in MODULES}
  for module, targets in GRAPH.items():
    graph[_unit(module)] |= {_unit(t) for t in targets} - {_unit(module)}
  return graph


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
  """Earlier layers only, or the module's own folder; not a peer."""
  upward = [
    f"{module} imports {target}"
    for module, targets in GRAPH.items()
    for target in targets
    if _unit(target) != _unit(module) and _layer(target) >= _layer(module)
  ]
  assert not upward, upward


# docs/architecture.md's picture: one line a layer, the top layer first, each
# "units [-> the units they import | -> all below]"; a subfolder (a path with
# its folder, like _kernels/mosaic/) on a line of its own under its folder.
_PICTURE = re.compile(r"^## The layers\n.*?```text\n(.*?)```", re.M | re.S)
_TOKEN = re.compile(r"(?<![\w/.])([\w/]+/|\w+\.py)(?![\w/])")


def _unit_of(token: str) -> str:
  return token.removesuffix("/").removesuffix(".py")


def _picture() -> list[tuple[list[str], str]]:
  """The picture's lines, top first: ``(tokens, what they import)``."""
  text = (ROOT / "docs" / "architecture.md").read_text()
  match = _PICTURE.search(text)
  assert match, "docs/architecture.md has no ```text picture under '## The layers'"
  rows = []
  for line in match.group(1).splitlines():
    units, _, imports = line.partition("->")
    if units.strip():
      tokens = _TOKEN.findall(units)
      assert tokens, f"no folder or module on the picture's line {line!r}"
      rows.append((tokens, imports.strip()))
  return rows


def test_the_picture_names_every_folder():
  """Each folder the picture names exists, and it names each folder of mst_jax."""
  named = {t.removesuffix("/") for tokens, _ in _picture() for t in tokens}
  folders = {
    p.relative_to(PACKAGE).as_posix()
    for p in PACKAGE.rglob("*")
    if p.is_dir() and "__pycache__" not in p.parts
  }
  modules = {p.name for p in PACKAGE.glob("*.py")}
  missing = named - folders - modules
  assert not missing, f"the picture names what mst_jax does not hold: {missing}"
  unnamed = folders - named
  assert not unnamed, f"docs/architecture.md's picture leaves out {unnamed}"


def test_the_picture_draws_the_layers_and_their_imports():
  """The picture's layers are ``LAYERS``, and the imports it draws for each
  line are the code's (an import between folders is drawn there too)."""
  rows = [
    ([_unit_of(t) for t in tokens], imports)
    for tokens, imports in _picture()
    if not any("/" in t.removesuffix("/") for t in tokens)
  ]
  drawn_layers = [sorted(units) for units, _ in reversed(rows)]
  assert drawn_layers == [sorted(group) for group in LAYERS], drawn_layers
  graph = _unit_graph()
  for depth, (units, imports) in enumerate(reversed(rows)):
    drawn = set(map(_unit_of, _TOKEN.findall(imports)))
    if imports == "all below":
      drawn = {u for group in LAYERS[:depth] for u in group}
    actual = set().union(*(graph[u] for u in units))
    assert drawn == actual, f"{units} import {sorted(actual)}; drawn: {sorted(drawn)}"


def test_private_modules_are_prefixed():
  public = {
    "mst_jax",
    "mst_jax.reference",
    "mst_jax.losses",
    "mst_jax.linen",
    "mst_jax.nnx",
  }
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
