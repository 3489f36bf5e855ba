"""The package's layers, as data: a module imports only from its own layer or below, and the launcher's side
never from the ranks' (docs/layout.md says the same in words). A new module belongs in a layer here: the test
fails until it has one."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "train"

# Lowest first. A name stands for a module or a package and everything in it.
LAYERS = [
    [
        "train.errors",
        "train.pdes",
        "train.hashing",
        "train.heap",
        "train.run_files",
        "train.strategies",
        "train.stop_signals",
    ],
    ["train.config", "train.disk"],
    ["train.atomic", "train.stores"],
    ["train.checkpoint", "train.obs", "train.data"],
    ["train.distributed", "train.model"],
    ["train.run_dir"],
    ["train.engine", "train.remote", "train.rank_start"],
    ["train.use", "train.worker", "train.smoke_worker"],
    ["train.launch", "train"],
    ["train.pipeline"],
    ["train.sweep"],
    ["train.cli"],
    ["train.__main__"],
    ["train.bench"],  # the benchmarks and GPU checks measure the product; nothing of it imports them
]
# The launcher (python -m train) and the ranks torchrun starts are two processes: what the launcher needs of the
# ranks' side lives below both.
LAUNCHER = ["train.launch", "train.pipeline"]
RANKS_ONLY = ["train.engine", "train.use", "train.worker", "train.rank_start", "train.smoke_worker"]


def _name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _owner(module: str, names: list[str]) -> str | None:
    """The longest name of ``names`` that ``module`` is or lies under."""
    found = [n for n in names if module == n or module.startswith(n + ".")]
    return max(found, key=len, default=None)


LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def _layer(module: str) -> int | None:
    owner = _owner(module, list(LAYER_OF))
    return None if owner is None else LAYER_OF[owner]


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of train.* in ``path``, inside functions too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("train")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("train"):
            for alias in node.names:
                # `from train import checkpoint` imports the module train.checkpoint, not the package train
                found.append((node.lineno, f"train.{alias.name}" if node.module == "train" else node.module))
    return found


def test_every_module_has_a_layer():
    missing = [_name(p) for p in sorted(PACKAGE.rglob("*.py")) if _layer(_name(p)) is None]
    assert not missing, f"modules in no layer of LAYERS: {missing}"


def test_no_module_imports_from_a_layer_above_its_own():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _name(path)
        for line, imported in _imports(path):
            if _layer(imported) is not None and _layer(imported) > _layer(module):
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} {module} imports {imported}")
    assert not upward, "imports from a layer above:\n" + "\n".join(upward)


def test_the_launcher_imports_nothing_of_the_ranks_side():
    crossing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _name(path)
        if _owner(module, LAUNCHER) is None:
            continue
        for line, imported in _imports(path):
            if _owner(imported, RANKS_ONLY) is not None:
                crossing.append(f"{path.relative_to(PACKAGE.parent)}:{line} {module} imports {imported}")
    assert not crossing, "the launcher's side imports the ranks':\n" + "\n".join(crossing)
