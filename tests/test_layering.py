"""The layering rules, read from the source by AST (like the acyclic-import test in tests/test_patches.py).

- ``recipes/`` (pure data) imports nothing from ``bridge_ext``, at any depth (function-level imports too);
- no module of ours imports a private name (leading underscore) of another of our modules, by
  ``from x import _y`` or as ``module._y`` through an imported module;
- no module loads one of our own modules by ``importlib.import_module`` / ``__import__`` (the import graph
  could not see it).

Tests are excluded: they may reach into private names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.once

REPO = Path(__file__).resolve().parents[1]
OURS = ("bridge_ext", "recipes")


def _sources(root: Path, *packages: str) -> list[Path]:
    return sorted(path for package in packages for path in (root / package).rglob("*.py"))


def _module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_ours(module: str | None) -> bool:
    return bool(module) and module.split(".")[0] in OURS


def _is_module(root: Path, dotted: str) -> bool:
    path = root.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _absolute(root: Path, node: ast.ImportFrom, path: Path) -> str | None:
    """The module an ``ImportFrom`` reads, relative imports resolved."""
    if not node.level:
        return node.module
    package = _module_name(root, path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _where(root: Path, path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(root)}:{node.lineno}"


def recipes_importing_bridge_ext(root: Path) -> list[str]:
    found = []
    for path in _sources(root, "recipes"):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                       else [_absolute(root, node, path)] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{_where(root, path, node)} imports {m}" for m in modules
                      if m and m.split(".")[0] == "bridge_ext"]
    return found


def test_recipes_import_nothing_from_bridge_ext():
    found = recipes_importing_bridge_ext(REPO)
    assert not found, "\n".join(found)


def test_recipes_import_without_bridge_ext_in_a_fresh_process():
    """Importing every recipe leaves ``bridge_ext`` (and its Transformer Engine import hook) unimported."""
    import subprocess
    import sys

    code = ("import sys, recipes, recipes.finetune, recipes.architecture; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('bridge_ext', 'torch', 'megatron')))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of attribute reads on a name, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def private_imports(root: Path) -> list[str]:
    found = []
    for path in _sources(root, *OURS):
        tree = ast.parse(path.read_text())
        modules = {}  # local name (or dotted path, for a plain ``import a.b.c``) -> our module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if _is_ours(alias.name):
                        found += [f"{_where(root, path, node)} imports {alias.name}"] if any(
                            _private(part) for part in alias.name.split(".")) else []
                        modules[alias.asname or alias.name] = alias.name
            elif isinstance(node, ast.ImportFrom):
                module = _absolute(root, node, path)
                if not _is_ours(module):
                    continue
                for alias in node.names:
                    if _private(alias.name) or any(_private(part) for part in module.split(".")):
                        found.append(f"{_where(root, path, node)} imports {alias.name} from {module}")
                    elif _is_module(root, f"{module}.{alias.name}"):
                        modules[alias.asname or alias.name] = f"{module}.{alias.name}"
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr) and _dotted(node.value) in modules:
                found.append(f"{_where(root, path, node)} reads {modules[_dotted(node.value)]}.{node.attr}")
    return found


def test_no_module_imports_a_private_name_of_another():
    found = private_imports(REPO)
    assert not found, "\n".join(found)


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "string"`` assignments (what ``import_module(NAME)`` may be passed)."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return out


def _leading_text(arg: ast.AST, constants: dict[str, str]) -> str | None:
    """The known start of a module-name argument: a literal, an f-string's first part or a module constant."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return str(arg.values[0].value)
    if isinstance(arg, ast.Name):
        return constants.get(arg.id)
    return None


def importlib_loads(root: Path) -> list[str]:
    found = []
    for path in _sources(root, *OURS):
        tree = ast.parse(path.read_text())
        constants = _constants(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name not in ("import_module", "__import__"):
                continue
            text = _leading_text(node.args[0], constants)
            if text is not None and text.split(".")[0] in OURS:  # a computed name is an upstream module (patches)
                found.append(f"{_where(root, path, node)} {name}({ast.unparse(node.args[0])})")
    return found


def test_no_importlib_loading_of_our_own_modules():
    found = importlib_loads(REPO)
    assert not found, "\n".join(found)


def test_the_checks_see_what_they_look_for(tmp_path):
    """Each check finds a planted violation (so a passing check is not a blind one)."""
    package = tmp_path / "recipes"
    package.mkdir()
    for name in ("__init__", "models", "params"):
        (package / f"{name}.py").write_text("")
    (package / "bad.py").write_text(
        "import importlib\n"
        "from bridge_ext.errors import UserError\n"
        "from .params import _attention\n"
        "def f(name):\n"
        "    from recipes import models as m\n"
        "    importlib.import_module(f'bridge_ext.{name}')\n"
        "    return m._qwen3\n")
    convert = tmp_path / "bridge_ext" / "convert"
    convert.mkdir(parents=True)
    for name in ("__init__", "parallel", "report"):
        (convert.parent / "__init__.py").write_text("")
        (convert / f"{name}.py").write_text("def _is_rank0():\n    return True\n" if name == "parallel" else "")
    (convert / "staging.py").write_text(  # each way one module can reach another's private name
        "import bridge_ext.convert.parallel\n"
        "import bridge_ext.convert.report as report\n"
        "from . import parallel\n"
        "from .parallel import _is_rank0\n"
        "from bridge_ext.convert.parallel import _is_rank0 as rank0, is_public\n"
        "def f():\n"
        "    return parallel._is_rank0(), report._say, bridge_ext.convert.parallel._barrier, _own_helper()\n"
        "def _own_helper():\n"
        "    return parallel.check_layout\n")
    assert recipes_importing_bridge_ext(tmp_path) == ["recipes/bad.py:2 imports bridge_ext.errors"]
    assert sorted(private_imports(tmp_path)) == sorted([
        "recipes/bad.py:3 imports _attention from recipes.params",
        "recipes/bad.py:7 reads recipes.models._qwen3",
        "bridge_ext/convert/staging.py:4 imports _is_rank0 from bridge_ext.convert.parallel",
        "bridge_ext/convert/staging.py:5 imports _is_rank0 from bridge_ext.convert.parallel",
        "bridge_ext/convert/staging.py:7 reads bridge_ext.convert.parallel._is_rank0",
        "bridge_ext/convert/staging.py:7 reads bridge_ext.convert.report._say",
        "bridge_ext/convert/staging.py:7 reads bridge_ext.convert.parallel._barrier",
    ])
    assert importlib_loads(tmp_path) == ["recipes/bad.py:6 import_module(f'bridge_ext.{name}')"]


def test_the_private_name_check_fails_on_a_planted_import(tmp_path):
    """The repository check itself (not only its helper) fails once one module imports another's private name:
    a copy of our packages with one such import planted."""
    import shutil

    for package in OURS:
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__", "*.json"))
    assert private_imports(tmp_path) == []  # the copy is as clean as the repository
    target = tmp_path / "bridge_ext" / "convert" / "cli.py"
    target.write_text("from bridge_ext.convert.parallel import _world_size\n" + target.read_text())
    assert private_imports(tmp_path) == ["bridge_ext/convert/cli.py:1 imports _world_size from bridge_ext.convert.parallel"]
