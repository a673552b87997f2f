"""The layering rules, read from the source by AST (like the acyclic-import test in tests/test_patches.py).

- ``recipes/`` (pure data) imports nothing from ``bridge_ext``, at any depth (function-level imports too);
- no module of ours imports a private name (leading underscore) of another of our modules, by
  ``from x import _y`` or as ``module._y`` through an imported module;
- no module loads one of our own modules by ``importlib.import_module`` / ``__import__`` (the import graph
  could not see it);
- the house (docs/architecture.md): no import cycle between rooms, at most 9 floors, no room over 15 % of the lines;
- no module outside ``bridge_ext/muon/`` holds Muon state; ``bridge_ext/patches`` imports only upstream code, the
  mechanism and what its rows wire in, which import nothing of ``bridge_ext.patches``.

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


def nodes_outside(root: Path, home: str, finding) -> list[str]:
    """``path:line finding`` for every AST node of ``bridge_ext/`` and ``recipes/`` but ``home`` (the fact's one
    module) for which ``finding(node)`` says what it does there (None: nothing), in file and line order."""
    found = []
    for path in [*_sources(root, "bridge_ext"), *_sources(root, "recipes")]:
        if path == root / home:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if what := finding(node):
                found.append((str(path.relative_to(root)), node.lineno, what))
    return [f"{where}:{line} {what}" for where, line, what in sorted(found)]


# --- one home per fact: the launcher's ranks ------------------------------------------------------------------

LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


def _is_os_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" and getattr(node.value, "id", None) == "os"


def _rank_read(node: ast.AST) -> str | None:
    name = None
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        func = node.func
        if isinstance(func, ast.Attribute) and (
                (func.attr == "get" and _is_os_environ(func.value))
                or (func.attr == "getenv" and getattr(func.value, "id", None) == "os")):
            name = node.args[0].value
    elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_os_environ(node.value):
        name = getattr(node.slice, "value", None)
    elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) and any(
            _is_os_environ(c) for c in node.comparators):
        name = node.left.value
    return f"reads {name}" if name in LAUNCHER_VARIABLES else None


def rank_variable_reads(root: Path) -> list[str]:
    """Reads of torchrun's rank variables (``os.environ.get(NAME)``, ``os.environ[NAME]``, ``NAME in os.environ``,
    ``os.getenv(NAME)``) outside ``bridge_ext/runtime.py``, their one home (``launcher_rank``,
    ``launcher_world_size``, ...). Writes (a launcher setting them) are not reads."""
    return nodes_outside(root, "bridge_ext/runtime.py", _rank_read)


def test_the_launchers_ranks_are_read_in_runtime_only():
    """torchrun's RANK, LOCAL_RANK and WORLD_SIZE are read in bridge_ext/runtime.py only (issue 49: WORLD_SIZE
    was read 7 times in 4 other files)."""
    found = rank_variable_reads(REPO)
    assert not found, "\n".join(found) + "\nuse bridge_ext.runtime's launcher_rank / launcher_world_size / ..."


def test_the_rank_read_check_sees_each_way_to_read(tmp_path):
    package = tmp_path / "bridge_ext"
    package.mkdir()
    (package / "runtime.py").write_text("import os\nRANK = os.environ.get('RANK')\n")  # the home: allowed
    (package / "bad.py").write_text(
        "import os\n"
        "a = int(os.environ.get('WORLD_SIZE', '1'))\n"
        "b = os.environ['LOCAL_RANK']\n"
        "c = 'RANK' in os.environ\n"
        "d = os.getenv('RANK')\n"
        "os.environ['RANK'] = '0'\n"  # a write
        "e = os.environ.get('HOME')\n")
    assert rank_variable_reads(tmp_path) == ["bridge_ext/bad.py:2 reads WORLD_SIZE",
                                             "bridge_ext/bad.py:3 reads LOCAL_RANK",
                                             "bridge_ext/bad.py:4 reads RANK", "bridge_ext/bad.py:5 reads RANK"]


def muon_name_tests(root: Path) -> list[str]:
    """Comparisons against a literal collection of Megatron's Muon optimizer names (``x in ("muon", "dist_muon")``)
    outside ``recipes.optimizers.is_muon``, their one home."""
    def literal_test(node: ast.AST) -> str | None:
        names = [{getattr(e, "value", None) for e in c.elts} for c in getattr(node, "comparators", ())
                 if isinstance(c, (ast.Tuple, ast.Set, ast.List))]
        hit = isinstance(node, ast.Compare) and any({"muon", "dist_muon"} <= n for n in names)
        return "tests the Muon names itself" if hit else None

    return nodes_outside(root, "recipes/optimizers.py", literal_test)


def test_is_this_muon_is_asked_of_one_function():
    """Which Megatron optimizer names run Muon is recipes.optimizers.is_muon's (issue 49: 11 literal tests in 7
    files); the next Muon variant is added there once."""
    found = muon_name_tests(REPO)
    assert not found, "\n".join(found) + "\nuse recipes.optimizers.is_muon"


def test_the_muon_name_check_sees_a_literal_test(tmp_path):
    (tmp_path / "bridge_ext").mkdir()
    (tmp_path / "recipes").mkdir()
    (tmp_path / "bridge_ext" / "bad.py").write_text("def f(o):\n    return o in ('dist_muon', 'muon') or o in {'sgd'}\n")
    (tmp_path / "recipes" / "optimizers.py").write_text("def is_muon(o):\n    return o in ('muon', 'dist_muon')\n")
    assert muon_name_tests(tmp_path) == ["bridge_ext/bad.py:2 tests the Muon names itself"]


def key_value_splits(root: Path) -> list[str]:
    """``.partition("=")`` / ``.split("=", ...)`` outside ``recipes/selection.py``, the key=value grammar's parser
    (``key_value``: the commands, the API, ``compare`` and ``bridge_ext.overrides`` use it)."""
    def split_at_equals(node: ast.AST) -> str | None:
        hit = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
               and node.func.attr in ("partition", "split", "rpartition") and node.args
               and getattr(node.args[0], "value", None) == "=")
        return "splits key=value itself" if hit else None

    return nodes_outside(root, "recipes/selection.py", split_at_equals)


def test_key_value_is_parsed_in_one_place():
    """The key=value grammar is parsed by recipes.selection.key_value only (issue 49: 10 hand-written
    partition("=") in 8 files)."""
    found = key_value_splits(REPO)
    assert not found, "\n".join(found) + "\nuse recipes.selection.key_value"


def test_the_key_value_check_sees_a_split(tmp_path):
    (tmp_path / "bridge_ext").mkdir()
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "selection.py").write_text("def key_value(i):\n    return i.partition('=')\n")
    (tmp_path / "bridge_ext" / "bad.py").write_text("a = 'k=v'.split('=', 1)\nb = 'a,b'.split(',')\n")
    assert key_value_splits(tmp_path) == ["bridge_ext/bad.py:1 splits key=value itself"]


def renames_outside_runtime(root: Path) -> list[str]:
    """``os.replace`` / ``os.rename`` / ``.rename(...)`` outside ``bridge_ext/runtime.py``, the home of atomic writes
    (``write_atomic``) and of moving finished work into place (``publish``, ``rename_into_place``)."""
    def renames(node: ast.AST) -> str | None:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            return None
        on_os = getattr(node.func.value, "id", None) == "os"
        hit = (on_os and node.func.attr in ("replace", "rename")) or (node.func.attr == "rename" and not on_os)
        return "renames itself" if hit else None

    return nodes_outside(root, "bridge_ext/runtime.py", renames)


def test_atomic_writes_and_publishes_have_one_home():
    """Atomic writes and renames into place live in bridge_ext.runtime (issue 49: five ad-hoc copies in launch.py,
    convert/stream/torch_dist.py, corpus.py, data.py, convert/staging.py)."""
    found = renames_outside_runtime(REPO)
    assert not found, "\n".join(found) + "\nuse bridge_ext.runtime's write_atomic / publish"


def test_the_rename_check_sees_each_way(tmp_path):
    (tmp_path / "bridge_ext").mkdir()
    (tmp_path / "recipes").mkdir()
    (tmp_path / "bridge_ext" / "runtime.py").write_text("import os\nos.replace('a', 'b')\n")
    (tmp_path / "bridge_ext" / "bad.py").write_text(
        "import os\nfrom pathlib import Path\nos.replace('a', 'b')\nos.rename('a', 'b')\nPath('a').rename('b')\n"
        "'text'.replace('t', 'T')\n")
    assert renames_outside_runtime(tmp_path) == [f"bridge_ext/bad.py:{line} renames itself" for line in (3, 4, 5)]


def matplotlib_users(root: Path) -> list[str]:
    """Imports of matplotlib outside ``bridge_ext/plots.py``, the one loss-figure maker."""
    def imports_matplotlib(node: ast.AST) -> str | None:
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        return "imports matplotlib" if any(n.split(".")[0] == "matplotlib" for n in names) else None

    return nodes_outside(root, "bridge_ext/plots.py", imports_matplotlib)


def test_loss_figures_have_one_maker():
    """Every loss figure is drawn through bridge_ext.plots.loss_figure (issue 49: three plotters, in training.py,
    compare/output.py and evaluate.py, each setting up matplotlib its own way)."""
    found = matplotlib_users(REPO)
    assert not found, "\n".join(found) + "\ndraw through bridge_ext.plots.loss_figure"


def test_the_matplotlib_check_sees_each_import(tmp_path):
    (tmp_path / "bridge_ext").mkdir()
    (tmp_path / "recipes").mkdir()
    (tmp_path / "bridge_ext" / "plots.py").write_text("import matplotlib\n")
    (tmp_path / "bridge_ext" / "bad.py").write_text("import os\nimport matplotlib.pyplot as plt\n"
                                                    "from matplotlib import cm\nfrom os import path\n")
    assert matplotlib_users(tmp_path) == [f"bridge_ext/bad.py:{line} imports matplotlib" for line in (2, 3)]


# `nemo llm info` shows a preset's fractions as they are (it derives nothing from them).
SCHEDULE_FRACTIONS_SHOWN_IN = ("bridge_ext/commands/info.py",)


def schedule_derivations(root: Path) -> list[str]:
    """Reads of a preset's ``schedule_fractions`` and calls of the WSD arithmetic outside ``recipes/budget.py``,
    where ``derived_schedule`` turns the fractions into iterations (``info`` may show the fractions)."""
    def derives(node: ast.AST) -> str | None:
        if isinstance(node, ast.Attribute) and node.attr == "schedule_fractions" and isinstance(node.ctx, ast.Load):
            return "reads schedule_fractions"
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "wsd_decay_iters":
            return "derives the WSD decay"
        return None

    return [f for f in nodes_outside(root, "recipes/budget.py", derives)
            if f.split(":")[0] not in SCHEDULE_FRACTIONS_SHOWN_IN]


def test_the_schedule_is_derived_in_one_place():
    """A preset's schedule fractions become iterations in recipes.budget.derived_schedule only (issue 49: composed
    twice, in recipes/__init__.py and through muon/presets.schedule_values): info, the build and the Muon tests
    read the same arithmetic."""
    found = schedule_derivations(REPO)
    assert not found, "\n".join(found) + "\ncall recipes.budget.derived_schedule"


def test_the_schedule_check_sees_each_way(tmp_path):
    (tmp_path / "bridge_ext" / "commands").mkdir(parents=True)
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "budget.py").write_text("def f(p):\n    return wsd_decay_iters(p.schedule_fractions)\n")
    (tmp_path / "bridge_ext" / "commands" / "info.py").write_text("def f(p):\n    return p.schedule_fractions\n")
    (tmp_path / "bridge_ext" / "bad.py").write_text(
        "def f(p, budget):\n    x = p.schedule_fractions\n    return budget.wsd_decay_iters(x, 10)\n")
    assert schedule_derivations(tmp_path) == ["bridge_ext/bad.py:2 reads schedule_fractions",
                                              "bridge_ext/bad.py:3 derives the WSD decay"]


# Outside bridge_ext/commands, the maintainers' `python -m` entries (docs/architecture.md).
ARGPARSE_ALSO_IN = ("bridge_ext/data.py", "bridge_ext/shipped_files.py", "bridge_ext/patches/__main__.py")


def argparse_users(root: Path) -> list[str]:
    """Modules outside ``bridge_ext/commands`` (and :data:`ARGPARSE_ALSO_IN`) that import argparse."""
    found = []
    for path in [*_sources(root, "bridge_ext"), *_sources(root, "recipes")]:
        where = str(path.relative_to(root))
        if where.startswith("bridge_ext/commands/") or where in ARGPARSE_ALSO_IN:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) else [])
            if "argparse" in names:
                found.append(f"{_where(root, path, node)} imports argparse")
    return sorted(found)


def test_only_commands_know_argparse():
    found = argparse_users(REPO)
    assert not found, "\n".join(found) + "\nparse in bridge_ext/commands; domain modules take keyword arguments"


def test_the_argparse_check_sees_an_import(tmp_path):
    (tmp_path / "bridge_ext" / "commands").mkdir(parents=True)
    (tmp_path / "recipes").mkdir()
    (tmp_path / "bridge_ext" / "commands" / "x.py").write_text("import argparse\n")
    (tmp_path / "bridge_ext" / "bad.py").write_text("import os\nfrom argparse import Namespace\n")
    assert argparse_users(tmp_path) == ["bridge_ext/bad.py:2 imports argparse"]


# --- Muon state, and what bridge_ext/patches may import ---------------------------------------------------------

# What a module of bridge_ext/patches may import of ours besides its own package, the mechanism (bridge_ext.upstream_patch),
# bridge_ext.stack and bridge_ext.errors (the ground floor): the packages whose behaviour its patches wire in
# (docs/architecture.md).
WIRED_IN = ("bridge_ext.muon", "bridge_ext.cpu", "bridge_ext.without_te", "bridge_ext.kill_safe", "bridge_ext.relayout")
PATCHES_MAY_IMPORT = ("bridge_ext.patches", "bridge_ext.upstream_patch", "bridge_ext.stack", "bridge_ext.errors", *WIRED_IN)
# Module-level values that hold nothing mutable, whatever their name.
_IMMUTABLE_CALLS = {"frozenset", "tuple", "str", "int", "float", "compile", "TypeVar", "Literal", "namedtuple"}


def _module_level(tree: ast.Module) -> list[ast.stmt]:
    """Statements that run at import: the module body and what ``if`` / ``try`` blocks there hold."""
    out, pending = [], list(tree.body)
    while pending:
        node = pending.pop(0)
        out.append(node)
        if isinstance(node, (ast.If, ast.Try)):
            pending += [*node.body, *node.orelse, *getattr(node, "finalbody", []),
                        *(s for handler in getattr(node, "handlers", []) for s in handler.body)]
    return out


def _our_imports(root: Path, path: Path, nodes) -> list[tuple[ast.AST, str]]:
    """(node, module) for each of our modules the import statements among ``nodes`` read (``from bridge_ext import
    patches`` reads ``bridge_ext.patches``)."""
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [(node, alias.name) for alias in node.names if _is_ours(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(root, node, path)
            if _is_ours(module):
                out += [(node, f"{module}.{alias.name}" if _is_module(root, f"{module}.{alias.name}") else module)
                        for alias in node.names]
    return out


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == package or module.startswith(package + ".") for package in packages)


def patches_importing_more(root: Path) -> list[str]:
    """Imports (at any depth) of a ``bridge_ext/patches`` module outside :data:`PATCHES_MAY_IMPORT`."""
    found = []
    for path in sorted((root / "bridge_ext" / "patches").rglob("*.py")):
        for node, module in _our_imports(root, path, ast.walk(ast.parse(path.read_text()))):
            if not _within(module, PATCHES_MAY_IMPORT):
                found.append(f"{_where(root, path, node)} imports {module}")
    return found


def wired_in_importing_the_registry(root: Path) -> list[str]:
    """A package patches wire in imports nothing of ``bridge_ext.patches`` (the registry imports it, to list rows
    that point at its code), at any depth: it switches its rows on through ``bridge_ext.upstream_patch`` (``apply``,
    ``temporarily``: the mechanism, which imports nothing of ours but ``stack``), and rows it declares itself (CPU
    mode's) build on the ``Patch`` type there."""
    found = []
    for package in WIRED_IN:
        base = root.joinpath(*package.split("."))
        paths = sorted(base.rglob("*.py")) if base.is_dir() else [base.with_suffix(".py")]
        for path in paths:
            for node, module in _our_imports(root, path, ast.walk(ast.parse(path.read_text()))):
                if _within(module, ("bridge_ext.patches",)):
                    found.append(f"{_where(root, path, node)} imports {module}")
    return found


def _names(target: ast.AST) -> list[str]:
    return [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]


def _mutable(value: ast.AST | None) -> bool:
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        callee = value.func.attr if isinstance(value.func, ast.Attribute) else getattr(value.func, "id", "")
        return callee not in _IMMUTABLE_CALLS
    return False


def _callee(value: ast.AST | None) -> str:
    if not isinstance(value, ast.Call):
        return ""
    return value.func.attr if isinstance(value.func, ast.Attribute) else getattr(value.func, "id", "")


def muon_state_outside_muon(root: Path) -> list[str]:
    """Module-level mutable objects about Muon (a name or class that says Muon: ``MUON = MuonRunTime()``,
    ``_muon_cache = {}``) in a module of ``bridge_ext`` outside ``bridge_ext/muon/``."""
    found = []
    muon = root / "bridge_ext" / "muon"
    for path in _sources(root, "bridge_ext"):
        if muon in path.parents:
            continue
        for node in _module_level(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                names, value = [n for t in node.targets for n in _names(t)], node.value
            elif isinstance(node, ast.AnnAssign):
                names, value = _names(node.target), node.value
            else:
                continue
            if _mutable(value) and any("muon" in text.lower() for text in (*names, _callee(value))):
                found.append(f"{_where(root, path, node)} {', '.join(names)}")
    return found


def test_muon_state_lives_in_bridge_ext_muon_only():
    found = muon_state_outside_muon(REPO)
    assert not found, "\n".join(found)


def test_patches_import_only_upstream_the_stack_and_what_they_wire_in():
    found = patches_importing_more(REPO) + wired_in_importing_the_registry(REPO)
    assert not found, "\n".join(found)


def test_the_muon_and_patches_checks_see_what_they_look_for(tmp_path):
    """Each check finds its planted violation in a copy of our packages (so a passing check is not a blind one)."""
    import shutil

    for package in OURS:
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__", "*.json"))
    assert muon_state_outside_muon(tmp_path) == patches_importing_more(tmp_path) == []
    assert wired_in_importing_the_registry(tmp_path) == []
    rows = tmp_path / "bridge_ext" / "patches" / "optimizer.py"
    rows.write_text(rows.read_text() + "\nMUON = MuonRunTime()\n_muon_seen: dict = {}\n"
                    "def f():\n    from bridge_ext import build\n")
    lines = len(rows.read_text().splitlines())
    assert muon_state_outside_muon(tmp_path) == [f"bridge_ext/patches/optimizer.py:{lines - 3} MUON",
                                                 f"bridge_ext/patches/optimizer.py:{lines - 2} _muon_seen"]
    assert patches_importing_more(tmp_path) == [f"bridge_ext/patches/optimizer.py:{lines} imports bridge_ext.build"]
    split = tmp_path / "bridge_ext" / "muon" / "split.py"
    split.write_text("from bridge_ext import patches\nfrom bridge_ext.patches.optimizer import PATCHES\n"
                     + split.read_text() + "\ndef g():\n    from bridge_ext.patches import apply\n")
    lines = len(split.read_text().splitlines())
    assert wired_in_importing_the_registry(tmp_path) == [
        "bridge_ext/muon/split.py:1 imports bridge_ext.patches",
        "bridge_ext/muon/split.py:2 imports bridge_ext.patches.optimizer",
        f"bridge_ext/muon/split.py:{lines} imports bridge_ext.patches"]


# --- the house: rooms, floors, sizes ------------------------------------------------------------------------------
#
# A room is ``recipes``, or one top-level module or sub-package of ``bridge_ext`` (its ``__init__.py``: the room
# ``bridge_ext``); an edge is any import (at any depth: function-level imports count) from one room to another; the
# floors are the rooms of the longest chain once the rooms of a cycle are taken as one (docs/architecture.md).

MAX_FLOORS = 9
MAX_ROOM_SHARE = 0.15


def _room(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    if parts[0] == "recipes":
        return "recipes"
    return "bridge_ext" if parts[1:] == ("__init__",) else f"bridge_ext.{parts[1]}"


def _room_of_module(root: Path, dotted: str) -> str | None:
    """The room an imported module (or ``module.name``) is in; None for anything not ours."""
    parts = dotted.split(".")
    if parts[0] == "recipes":
        return "recipes"
    if parts[0] != "bridge_ext":
        return None
    if len(parts) > 1 and _is_module(root, f"bridge_ext.{parts[1]}"):
        return f"bridge_ext.{parts[1]}"
    return "bridge_ext"  # a name of bridge_ext/__init__.py


def house(root: Path) -> tuple[dict[str, int], dict[str, set[str]]]:
    """``({room: lines}, {room: rooms it imports})`` of the packages under ``root`` (tests/ not counted)."""
    lines: dict[str, int] = {}
    edges: dict[str, set[str]] = {}
    for path in _sources(root, *OURS):
        room, text = _room(root, path), path.read_text()
        lines[room] = lines.get(room, 0) + len(text.splitlines())
        targets = edges.setdefault(room, set())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = _absolute(root, node, path)
                # ``from bridge_ext import patches`` reads the module bridge_ext.patches, not bridge_ext/__init__
                subs = [f"{module}.{alias.name}" for alias in node.names] if module else []
                found = [sub for sub in subs if _is_module(root, sub) or root.joinpath(*sub.split(".")).is_dir()]
                modules = found if subs and len(found) == len(subs) else [m for m in (module, *found) if m]
            else:
                continue
            targets.update(r for m in modules if (r := _room_of_module(root, m)) not in (None, room))
    return lines, {room: {t for t in targets if t in lines} for room, targets in edges.items()}


def _components(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components (Tarjan), each sorted; a room on no cycle is one of its own."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(room: str) -> None:
        index[room] = low[room] = len(index)
        stack.append(room)
        for other in sorted(edges[room]):
            if other not in index:
                visit(other)
                low[room] = min(low[room], low[other])
            elif other in stack:
                low[room] = min(low[room], index[other])
        if low[room] == index[room]:
            component = []
            while not component or component[-1] != room:
                component.append(stack.pop())
            out.append(sorted(component))

    for room in sorted(edges):
        if room not in index:
            visit(room)
    return out


def room_cycles(edges: dict[str, set[str]]) -> list[str]:
    """One import cycle per group of rooms that import each other, named room by room: ``a -> b -> a``."""
    found = []
    for component in _components(edges):
        if len(component) < 2:
            continue
        inside = set(component)
        trail = [component[0]]
        while True:  # walk inside the component until a room comes back: that loop is a cycle
            nxt = min(edges[trail[-1]] & inside)
            if nxt in trail:
                loop = trail[trail.index(nxt):] + [nxt]
                break
            trail.append(nxt)
        found.append(" -> ".join(loop) + f" (rooms on cycles with each other: {', '.join(component)})")
    return found


def longest_chain(edges: dict[str, set[str]]) -> list[list[str]]:
    """The floors: the longest chain of imports, top to bottom, the rooms of a cycle counted as one floor."""
    components = _components(edges)
    of = {room: n for n, component in enumerate(components) for room in component}
    below: dict[int, list[list[str]]] = {}
    for n, component in enumerate(components):  # Tarjan gives the ones a component imports first
        chains = [below[of[other]] for room in component for other in edges[room] if of[other] != n]
        below[n] = [component, *max(chains, key=len, default=[])]
    return max(below.values(), key=len, default=[])


def large_rooms(lines: dict[str, int]) -> list[str]:
    total = sum(lines.values())
    return [f"{room} holds {count / total:.1%} of the lines ({count} of {total}; at most {MAX_ROOM_SHARE:.0%})"
            for room, count in sorted(lines.items()) if count > MAX_ROOM_SHARE * total]


def test_no_import_cycle_between_rooms():
    _, edges = house(REPO)
    found = room_cycles(edges)
    assert not found, "\n".join(found)


def test_the_house_has_at_most_nine_floors():
    chain = longest_chain(house(REPO)[1])
    assert len(chain) <= MAX_FLOORS, f"{len(chain)} floors: " + " -> ".join("{" + ", ".join(c) + "}" if len(c) > 1
                                                                           else c[0] for c in chain)


def test_no_room_holds_more_than_15_percent_of_the_lines():
    found = large_rooms(house(REPO)[0])
    assert not found, "\n".join(found)


def test_the_house_checks_see_what_they_look_for(tmp_path):
    """A planted house: a chain of 11 rooms (function-level and ``from bridge_ext import x`` imports), a cycle between
    two packages, one room with most of the lines; and the repository's own house with a cycle planted into it."""
    import shutil

    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "__init__.py").write_text("X = 1\n")
    package = tmp_path / "bridge_ext"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for n in range(10):  # m0 -> m1 -> ... -> m9 -> recipes, each way of importing once
        imports = ["def f():\n    from bridge_ext import m{}\n", "import bridge_ext.m{}.inner\n",
                   "from bridge_ext.m{} import name\n", "from . import m{}\n"][n % 4].format(n + 1)
        if n == 9:
            imports = "from recipes import X\n"
        (package / f"m{n}.py").write_text(imports)
    (package / "m2").mkdir()  # m1 imports bridge_ext.m2.inner: m2 is a package room
    (package / "m2.py").rename(package / "m2" / "__init__.py")
    (package / "m2" / "inner.py").write_text("")
    (package / "m6").mkdir()
    (package / "m6.py").rename(package / "m6" / "__init__.py")
    (package / "m6" / "inner.py").write_text("")
    for name, other in (("x", "y"), ("y", "x")):
        (package / name).mkdir()
        (package / name / "__init__.py").write_text(f"def f():\n    from bridge_ext.{other}.z import g\n")
        (package / name / "z.py").write_text("\n" * 2000)
    lines, edges = house(tmp_path)
    assert edges["bridge_ext.m3"] == {"bridge_ext.m4"} and edges["bridge_ext.m1"] == {"bridge_ext.m2"}
    assert room_cycles(edges) == ["bridge_ext.x -> bridge_ext.y -> bridge_ext.x "
                                  "(rooms on cycles with each other: bridge_ext.x, bridge_ext.y)"]
    assert longest_chain(edges) == [[f"bridge_ext.m{n}"] for n in range(10)] + [["recipes"]]
    assert [line.split(" holds")[0] for line in large_rooms(lines)] == ["bridge_ext.x", "bridge_ext.y"]

    for name in OURS:
        shutil.copytree(REPO / name, tmp_path / "repo" / name, ignore=shutil.ignore_patterns("__pycache__", "*.json"))
    copy = tmp_path / "repo"
    assert room_cycles(house(copy)[1]) == []
    stack = copy / "bridge_ext" / "stack.py"  # the ground floor reaching up to the recipe pipeline
    stack.write_text(stack.read_text() + "\ndef planted():\n    from bridge_ext.build import resolve\n")
    found = room_cycles(house(copy)[1])
    assert len(found) == 1 and "bridge_ext.build" in found[0] and "bridge_ext.stack" in found[0], found
    cycle_below = {"w": {"x"}, "x": {"y"}, "y": {"x", "z"}, "z": set()}  # the rooms of a cycle are one floor
    assert longest_chain(cycle_below) == [["w"], ["x", "y"], ["z"]]
