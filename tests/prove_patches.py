"""Each patch row that applies on this stack, switched off, must make its proving test fail (issue 39).

    python tests/prove_patches.py [NAME ...] [--no-redirects] [--timeout S] [--json FILE] [--record] [--stale]

For each row (default: every row that applies here and names a test, bridge_ext/patches/evidence.py) runs
``pytest <test> -x`` in a fresh process with ``BRIDGE_EXT_PATCHES_OFF=<row>`` and prints one line per row:
``needed`` (the test failed: the bug is real on this stack), ``NOT SHOWN`` (the test passed without the row:
upstream fixed it, or the test does not reach the row's code), ``timeout``. Exit 1 when a row is not shown.

``--record``: each row shown needed is written to ``bridge_ext/patches/proofs.json`` for this stack (the lock
whose versions are installed): the commit and the row's :func:`fingerprint`. ``--stale``: prove only the rows
whose record for this stack is missing or out of date (tests/test_patch_proofs.py lists them, on every CI run).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bridge_ext.patches.evidence import PROOFS, read_proofs  # noqa: E402  (the records' one reader)


def _source_of(function: Any) -> str:
    """A row's callable as text: its source, and what its closure holds that decides what it does (a rewrite's
    qualname and replacements, a function of ours it wraps); unstable values (objects) are left out."""
    function = getattr(function, "func", function)  # functools.partial
    try:
        text = inspect.getsource(function)
    except (OSError, TypeError):
        text = getattr(function, "__qualname__", type(function).__name__)
    for cell in getattr(function, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, (str, int, float, bool, tuple, frozenset)) and "object at 0x" not in repr(value):
            text += "\n" + repr(value)
        elif callable(value) and getattr(value, "__module__", "").startswith("bridge_ext"):
            text += "\n" + _source_of(value)
    return text


def test_source(test: str, root: Path = ROOT) -> str:
    """The proving test's function (decorators included) as it reads in ``root`` (``path::name[case]``)."""
    path, name = test.split("::")
    name = name.split("[")[0]
    text = (root / path).read_text()
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
            return "\n".join(text.splitlines()[start:node.end_lineno])
    raise LookupError(f"{test}: no such test function")


def fingerprint(patch: Any, test: str | None, *, switched_with: tuple[str, ...] = (), fails_with: str | None = None,
                root: Path = ROOT) -> str:
    """What a row's proof rests on, hashed: the row (target, scope, condition, snippets, the code that decides and
    makes it), its proving test's source and the failure that test must show. A change to either makes the recorded proof out of date; a change to
    its wording (``upstream``, ``why``, ``when``) or to the file around it does not."""
    parts = [patch.name, patch.module, patch.attr, patch.scope, repr(patch.snippets), repr(patch.elsewhere),
             repr(patch.must_exist), repr(sorted(switched_with))]
    parts += [_source_of(f) for f in (patch.make, patch.install, patch.hook, patch.needed, patch.accepts)
              if f is not None]
    parts.append(test_source(test, root) if test else "")
    parts.append(fails_with or "")
    return hashlib.sha256("\n\x00".join(parts).encode()).hexdigest()[:16]


def locked_pins(root: Path = ROOT) -> dict[str, dict[str, str]]:
    """STACK name -> its pins (requirements/lock-<STACK>.txt)."""
    stacks = {}
    for lock in sorted((root / "requirements").glob("lock-*.txt")):
        stacks[lock.stem.removeprefix("lock-")] = dict(
            line.split(" ")[0].split("==", 1) for line in lock.read_text().splitlines()
            if "==" in line and not line.startswith("#"))
    return stacks


def this_stack() -> str:
    """The locked stack whose Megatron packages are installed here."""
    from importlib.metadata import version

    names = ("megatron-bridge", "megatron-core", "emerging-optimizers")
    installed = {name: version(name) for name in names}
    found = [stack for stack, pins in locked_pins().items() if all(pins.get(n) == installed[n] for n in names)]
    if len(found) != 1:
        print(f"error: no single requirements/lock-*.txt pins the installed {installed}; run the prover in a "
              "stack's venv (make install STACK=NAME)", file=sys.stderr)
        raise SystemExit(2)
    return found[0]


def write_proofs(rows: dict[str, dict[str, dict[str, str]]]) -> None:
    ordered = {row: dict(sorted(by_stack.items())) for row, by_stack in sorted(rows.items())}
    body = {"about": "where each patch row was last shown needed (tests/prove_patches.py --record): per stack the "
                     "commit and the row's fingerprint (its code and its proving test); tests/test_patch_proofs.py "
                     "fails when a row that applies on a stack has no current proof there",
            "rows": ordered}
    lines = ",\n".join(f"  {json.dumps(row)}: {json.dumps(by_stack)}" for row, by_stack in ordered.items())
    PROOFS.write_text(f'{{\n "about": {json.dumps(body["about"])},\n "rows": {{\n{lines}\n }}\n}}\n')


def current_fingerprints() -> dict[str, str]:
    """row name -> :func:`fingerprint` of the installed registry, for every row with a proving test."""
    from bridge_ext import patches
    from bridge_ext.patches import evidence

    return {p.name: fingerprint(p, evidence.proven_by(p.name), switched_with=evidence.SWITCHED_WITH.get(p.name, ()),
                                fails_with=evidence.FAILS_WITH.get(p.name))
            for p in patches.REGISTRY if evidence.proven_by(p.name)}


def _head() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", f":!{PROOFS.relative_to(ROOT)}"],
                           cwd=ROOT, capture_output=True, text=True).stdout.strip()  # the records being written: not
    return done.stdout.strip() + ("+" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*")
    parser.add_argument("--no-redirects", action="store_true", help="leave out CPU mode's cuda-on-cpu rows")
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--record", action="store_true",
                        help="write each row shown needed to bridge_ext/patches/proofs.json")
    parser.add_argument("--stale", action="store_true", help="only the rows without a current proof on this stack")
    args = parser.parse_args(argv)
    from bridge_ext import patches
    from bridge_ext.patches import evidence

    unknown = sorted(set(args.names) - {p.name for p in patches.REGISTRY})
    if unknown:
        print(f"error: no patch row named {', '.join(unknown)} (python -m bridge_ext.patches lists them)",
              file=sys.stderr)
        return 2
    here = patches.applied_here()
    names = args.names or [name for name in here if evidence.proven_by(name)
                           and not (args.no_redirects and name.startswith("cuda-on-cpu "))]
    stack, fingerprints = this_stack(), current_fingerprints()
    proofs = read_proofs()
    if args.stale:
        names = [name for name in names
                 if proofs.get(name, {}).get(stack, {}).get("fingerprint") != fingerprints.get(name)]
        print(f"{stack}: {len(names)} rows without a current proof", flush=True)
    results, failed = [], False
    for name in names:
        test = evidence.proven_by(name)
        if name not in here or test is None:
            results.append({"row": name, "test": test, "result": "does not apply here" if test else "no test"})
            print(f"{name}: {results[-1]['result']}", flush=True)
            continue
        off = (name, *evidence.SWITCHED_WITH.get(name, ()))
        shown = next((r for r in results if r.get("off") == sorted(off) and r["test"] == test
                      and name not in evidence.FAILS_WITH), None)
        if shown is not None:  # the same rows off, the same test: one run shows them all (SWITCHED_WITH)
            results.append({**shown, "row": name, "seconds": 0})
            result = shown["result"]
            print(f"{name}: {result} (switched off with {shown['row']}: the same run)", flush=True)
        else:
            result = prove(name, test, off, timeout=args.timeout, results=results,
                           fails_with=evidence.FAILS_WITH.get(name))
        failed |= result != "needed"
        if args.record and result == "needed":
            proofs = read_proofs()  # another stack's prover may have written since
            proofs.setdefault(name, {})[stack] = {"commit": _head(), "fingerprint": fingerprints[name]}
            write_proofs(proofs)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 1 if failed else 0


def prove(name: str, test: str, off: tuple[str, ...], *, timeout: int, results: list[dict[str, Any]],
          fails_with: str | None = None) -> str:
    """Run ``test`` with the rows ``off`` switched off; appends the result to ``results`` and returns it: "needed"
    only when the test fails (and its output holds ``fails_with``, the row's own failure, where one is named)."""
    from bridge_ext.patches.registry import SWITCH_OFF_ENV

    start = time.time()
    env = {**os.environ, SWITCH_OFF_ENV: ",".join(off)}
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", test, "-x", "-q", "-p", "no:cacheprovider"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        result = "needed" if done.returncode == 1 else "NOT SHOWN" if done.returncode == 0 else \
            f"pytest exit {done.returncode}"
        last = (done.stdout.strip().splitlines() or [""])[-1]
        reason = next((line[2:].strip() for line in done.stdout.splitlines() if line.startswith("E ")), "")
        if result == "needed" and fails_with and fails_with not in done.stdout:
            result = f"fails otherwise (not with {fails_with!r})"
    except subprocess.TimeoutExpired:
        result, last, reason = "timeout", "", ""
    results.append({"row": name, "test": test, "result": result, "seconds": round(time.time() - start),
                    "pytest": last, "reason": reason[:300], "off": sorted(off)})
    print(f"{name}: {result} ({results[-1]['seconds']} s; {test}: {last})", flush=True)
    return result


if __name__ == "__main__":
    sys.exit(main())
