"""Imports run one way: models/ <- decoding/ <- train/ (docs/design.md §1).

models/ (the frozen target wrapper, the draft modules, their contract) imports neither
decoding/ nor train/; decoding/ (verification, loops, drafters, metrics) does not import
train/. Checked twice: statically, every import statement of every module (top level,
inside functions, under `if TYPE_CHECKING`), and at run time, importing the modules of a
layer in a fresh interpreter and looking at what landed in sys.modules.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("models", "decoding", "train")  # bottom to top
ABOVE = {"models": ("decoding", "train"), "decoding": ("train",), "train": ()}


def module_files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, imported module, inside a function or an `if` block) of every import in `path`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.If)
            if isinstance(child, ast.Import):
                found.extend((child.lineno, alias.name, nested) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = package[: len(package) - child.level + 1] if child.level else []
                name = ".".join([*base, child.module] if child.module else base)
                found.append((child.lineno, name, nested))
            visit(child, inner)

    visit(tree, False)
    return found


LOWER_FILES = [p for pkg in ("models", "decoding") for p in module_files(pkg)]


@pytest.mark.parametrize("path", LOWER_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_import_of_a_higher_layer(path: Path):
    layer = path.relative_to(ROOT).parts[0]
    upward = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for line, name, _ in imports(path)
        if name.split(".")[0] in ABOVE[layer]
    ]
    assert not upward, (
        f"{layer}/ must not import {' or '.join(ABOVE[layer])} (models <- decoding <- train): "
        + "; ".join(upward)
    )


ALL_FILES = [p for pkg in PACKAGES for p in module_files(pkg)]
SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))
MAX_LINES = 450  # a file a reader holds in their head


@pytest.mark.parametrize("path", ALL_FILES + SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_project_imports_sit_at_the_top_of_the_module(path: Path):
    """An import of project code inside a function (or under `if TYPE_CHECKING`) is how a
    cycle hides; with one-way layers none is needed. Optional third-party imports (peft,
    matplotlib) may stay inside the functions that use them."""
    hidden = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for line, name, nested in imports(path)
        if nested and name.split(".")[0] in PACKAGES
    ]
    assert not hidden, "move these imports to the top of the module: " + "; ".join(hidden)


@pytest.mark.parametrize("layer", ["models", "decoding"])
def test_importing_a_layer_loads_no_higher_layer(layer: str):
    """Import every module of `layer`, one after another, in a fresh interpreter; after each,
    no module of a higher layer may be in sys.modules (the first module that pulls one in
    is named). One interpreter per layer: the union of the modules' imports is clean iff
    each module's is."""
    names = [module_name(p) for p in module_files(layer)]
    script = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        f"    loaded = sorted(m for m in sys.modules if m.split('.')[0] in {ABOVE[layer]!r})\n"
        "    if loaded:\n"
        "        print(f'import {name} loaded {loaded}')\n"
        "        sys.exit(1)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


def test_no_python_file_is_over_the_size_a_reader_holds():
    """Packages, scripts, tests and the entry point alike: split by responsibility."""
    tracked = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    untracked = subprocess.run(
        ["git", "ls-files", "--others", "--exclude-standard", "*.py"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    sizes = {
        n: len((ROOT / n).read_text().splitlines())
        for n in tracked + untracked
        if (ROOT / n).exists()
    }
    over = {n: lines for n, lines in sizes.items() if lines > MAX_LINES}
    assert sizes and not over, f"over {MAX_LINES} lines: {over}"


def test_scripts_do_not_edit_sys_path():
    """The project is installed (scripts/setup.sh): a script imports it as it is."""
    edits = [p.name for p in SCRIPTS if "sys.path" in p.read_text()]
    assert not edits, f"scripts that edit sys.path: {edits}"


# Built from parts so that this file itself does not match.
OUTSIDE_REFS = ("../" + "shared", "shared/" + "design.md")


def test_no_file_refers_outside_the_project():
    # A clone has only the project: it documents itself (docs/design.md).
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    offenders = [
        name
        for name in tracked
        if name.endswith((".py", ".md", ".yaml", ".sh", ".toml", ".ipynb"))
        and any(ref in (ROOT / name).read_text(errors="ignore") for ref in OUTSIDE_REFS)
    ]
    assert not offenders, f"files that refer outside the project (a clone lacks it): {offenders}"


# train/'s rooms, bottom to top: a module imports its own room's modules and lower rooms'
# only (docs/design.md §1). disk.py, phase_memory.py and loop.py are rooms of one file; train/__init__.py
# registers the config resolvers (run/resolvers.py) and is no room.
ROOMS = (
    "disk",
    "phase_memory",
    "parallel",
    "losses",
    "data",
    "report",
    "core",
    "formats",
    "eval",
    "run",
    "loop",
)
TRAIN_FILES = [p for p in module_files("train") if p != ROOT / "train" / "__init__.py"]


def room_of(name: str) -> str:
    return name.split(".")[1] if name.count(".") >= 1 else ""


@pytest.mark.parametrize("path", TRAIN_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_train_rooms_import_one_way(path: Path):
    room = room_of(module_name(path))
    assert room in ROOMS, f"{path.relative_to(ROOT)} is in no room of {ROOMS}: put it in one"
    upward = [
        f"{path.relative_to(ROOT)}:{line} imports {name} (room {room_of(name)})"
        for line, name, _ in imports(path)
        if name.startswith("train.") and ROOMS.index(room_of(name)) > ROOMS.index(room)
    ]
    assert not upward, f"rooms import downward only ({' <- '.join(ROOMS)}): " + "; ".join(upward)


def test_train_has_few_loose_files_and_design_names_every_file():
    loose = sorted(p.name for p in (ROOT / "train").glob("*.py"))
    assert len(loose) <= 10, f"train/ holds {len(loose)} loose files: {loose}; put them in rooms"
    rows = {  # docs/design.md's table of rooms: "| `room/` | ... `file.py` ... |"
        line.split("`")[1]: line
        for line in (ROOT / "docs" / "design.md").read_text().splitlines()
        if line.startswith("| `") and line.split("`")[1].endswith("/")
    }
    unnamed = [
        str(p.relative_to(ROOT / "train"))
        for p in TRAIN_FILES
        if p.parent != ROOT / "train" and p.name != "__init__.py"
        and f"`{p.name}`" not in rows.get(p.parent.name + "/", "")
    ]  # fmt: skip
    assert not unnamed, f"docs/design.md's table of train/'s rooms names no {unnamed}"


# Past the set-up the config travels no further (docs/design.md §1): train/run/ reads it once and
# hands each room below the values it uses, so no module under it imports omegaconf. The only
# modules that do read a file a run wrote, as a run wrote it.
READS_A_RUNS_FILES = {
    "train/core/checkpoint.py": "rebuilds a checkpoint's draft from its saved draft.yaml",
    "train/formats/export.py": "loads a checkpoint's saved config.yaml to rebuild its target",
    "train/formats/kinds.py": "reads a checkpoint's saved draft.yaml for its export kind",
    "train/report/runs.py": "loads finished runs' config.yaml to group and compare them",
}
BELOW_THE_SET_UP = [
    p for p in TRAIN_FILES if room_of(module_name(p)) in ROOMS[: ROOMS.index("run")]
]


@pytest.mark.parametrize("path", BELOW_THE_SET_UP, ids=lambda p: str(p.relative_to(ROOT)))
def test_rooms_below_the_set_up_take_values_not_the_config(path: Path):
    name = str(path.relative_to(ROOT))
    config = [
        f"{name}:{line} imports {module}"
        for line, module, _ in imports(path)
        if module.split(".")[0] == "omegaconf"
    ]
    if name in READS_A_RUNS_FILES:
        assert config, f"{name} no longer reads a run's files: drop it from READS_A_RUNS_FILES"
        return
    assert not config, (
        "the config stops at train/run/ (it builds the values each room takes, e.g. "
        "train/run/settings.py: eval_settings): " + "; ".join(config)
    )
