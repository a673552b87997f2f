"""What a CI run cost, from its log: per stack the install and pytest seconds, the test counts and the slowest tests.

    python3 .ci/report.py stack STACK INSTALL_S PYTEST_S PYTEST_LOG SELECTION   # .ci/run: one stack's lines
    python3 .ci/report.py table CI_LOG        # docs/testing.md's table from a whole .ci/run log

Standard library only (it runs before any venv exists). The ``stack`` lines are the ones ``table`` reads back.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

__all__ = ["counts", "slowest", "stack_lines", "table"]

_COUNT = re.compile(r"(\d+) (passed|failed|skipped|xfailed|xpassed|errors?|deselected)")
_SUMMARY = re.compile(r"^=+ .*\b(passed|failed|errors?|skipped|no tests ran)\b.* in [\d.]+s.*=+$")
_DURATION = re.compile(r"^\s*([\d.]+)s (call|setup|teardown)\s+(\S.*?)\s*$")  # an id may hold spaces
_STACK_LINE = re.compile(
    r"^ci: STACK=(?P<stack>\S+) install (?P<install>\d+) s, pytest (?P<pytest>\d+) s: (?P<counts>.*?) "
    r"\((?P<selection>.*)\)$")
_SLOW_LINE = re.compile(r"^ci: STACK=(?P<stack>\S+) slow: +(?P<seconds>[\d.]+) s (?P<test>.+)$")
_WORKERS = re.compile(r"^workers: .*$", re.MULTILINE)  # tests/conftest.py: when each worker ended
_CPU = re.compile(r"^cpu: .*$", re.MULTILINE)  # tests/conftest.py: the CPU seconds in all and the costliest phases


def counts(log: str) -> dict[str, int]:
    """pytest's final counts (``passed``, ``failed``, ``skipped``, ...) from its last summary line."""
    lines = [line for line in log.splitlines() if _SUMMARY.match(line.strip())]
    if not lines:
        return {}
    return {kind.rstrip("s") if kind.startswith("error") else kind: int(n) for n, kind in _COUNT.findall(lines[-1])}


def slowest(log: str, n: int = 15) -> list[tuple[float, str]]:
    """The ``n`` slowest test phases pytest's ``--durations`` printed, slowest first."""
    found = [(float(m.group(1)), f"{m.group(3)} ({m.group(2)})" if m.group(2) != "call" else m.group(3))
             for line in log.splitlines() if (m := _DURATION.match(line))]
    return sorted(found, reverse=True)[:n]


def stack_lines(stack: str, install_s: int, pytest_s: int, log: str, selection: str) -> list[str]:
    """One stack's summary lines (what ``table`` reads back)."""
    found = counts(log)
    shown = ", ".join(f"{found.get(kind, 0)} {kind}" for kind in ("passed", "failed", "skipped", "error")) \
        if found else "no pytest summary (stopped or did not start)"
    lines = [f"ci: STACK={stack} install {install_s} s, pytest {pytest_s} s: {shown} ({selection})"]
    lines += [f"ci: STACK={stack} {m.group(0)}" for m in _WORKERS.finditer(log)][-1:]
    lines += [f"ci: STACK={stack} slow: {seconds:8.1f} s {test}" for seconds, test in slowest(log)]
    lines += [f"ci: STACK={stack} {m.group(0)}" for m in _CPU.finditer(log)]
    return lines


def table(ci_log: str, *, heaviest: int = 5) -> str:
    """docs/testing.md's measured table (markdown) from a whole ``.ci/run`` log."""
    rows, slow = [], {}
    for line in ci_log.splitlines():
        if m := _STACK_LINE.match(line):
            rows.append(m.groupdict())
        elif m := _SLOW_LINE.match(line):
            slow.setdefault(m["stack"], []).append((float(m["seconds"]), m["test"]))
    out = ["| stack | selection | install | pytest | tests |", "|---|---|---|---|---|"]
    for row in rows:
        out.append(f"| `{row['stack']}` | {row['selection']} | {row['install']} s | {row['pytest']} s | "
                   f"{row['counts']} |")
    whole = re.search(r"^ci: all stacks: (\d+ s of the \d+ s target)", ci_log, re.MULTILINE)  # .ci/run's TARGET_S
    out.append(f"| all | | {sum(int(r['install']) for r in rows)} s | {sum(int(r['pytest']) for r in rows)} s | "
               f"{whole.group(1) if whole else 'not run to the end'} |")
    for stack, tests in slow.items():
        out += ["", f"The {heaviest} costliest on `{stack}`:", ""]
        out += [f"- {seconds:.0f} s `{test}`" for seconds, test in sorted(tests, reverse=True)[:heaviest]]
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) == 6 and argv[0] == "stack":
        stack, install_s, pytest_s, log, selection = argv[1:]
        text = Path(log).read_text(errors="replace") if Path(log).exists() else ""
        print("\n".join(stack_lines(stack, int(install_s), int(pytest_s), text, selection)))
        return 0
    if len(argv) == 2 and argv[0] == "table":
        print(table(Path(argv[1]).read_text(errors="replace")), end="")
        return 0
    print("usage: python3 .ci/report.py stack STACK INSTALL_S PYTEST_S PYTEST_LOG SELECTION | table CI_LOG",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
