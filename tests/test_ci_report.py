"""`.ci/report.py`: the per-stack lines `.ci/run` prints and docs/testing.md's table made from them, on a log
written here by hand (pytest's summary and ``--durations`` lines as pytest 9 prints them)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.once  # standard library only: the same on every stack

REPO = Path(__file__).resolve().parents[1]
PYTEST_LOG = """\
============================= slowest 15 durations =============================
207.41s setup    tests/test_layout_matrix.py::test_cycle
60.41s setup    tests/test_muon_layouts.py::test_one_step
37.25s call     tests/test_kill_safe.py::test_sigterm[setting up]
0.40s teardown tests/test_a.py::test_b
=========================== short test summary info ============================
SKIPPED [2] tests/test_upstream_api.py:73: gone
workers: gw1 ended at 281 s, gw0 ended at 300 s; the last ran alone for 19 s
cpu: 514 s in all; the 15 costliest phases:
cpu:    189.8 s tests/test_layout_matrix.py::test_cycle (setup)
=========== 374 passed, 1 failed, 2 skipped, 50 warnings in 300.64s (0:05:00) ============
"""


def _report():
    spec = importlib.util.spec_from_file_location("ci_report", REPO / ".ci" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_stacks_lines_and_the_table_made_from_them(tmp_path):
    report = _report()
    assert report.counts(PYTEST_LOG) == {"passed": 374, "failed": 1, "skipped": 2}
    assert report.slowest(PYTEST_LOG, 2) == [(207.41, "tests/test_layout_matrix.py::test_cycle (setup)"),
                                             (60.41, "tests/test_muon_layouts.py::test_one_step (setup)")]
    log = tmp_path / "pytest.log"
    log.write_text(PYTEST_LOG)
    run = subprocess.run([sys.executable, str(REPO / ".ci" / "report.py"), "stack", "26.08", "22", "301", str(log),
                          "-m stack"], capture_output=True, text=True, check=True)
    lines = run.stdout.splitlines()
    assert lines[0] == "ci: STACK=26.08 install 22 s, pytest 301 s: 374 passed, 1 failed, 2 skipped, 0 error (-m stack)"
    assert lines[1] == "ci: STACK=26.08 workers: gw1 ended at 281 s, gw0 ended at 300 s; the last ran alone for 19 s"
    assert lines[4] == "ci: STACK=26.08 slow:     37.2 s tests/test_kill_safe.py::test_sigterm[setting up]"
    assert lines[6:] == ["ci: STACK=26.08 cpu: 514 s in all; the 15 costliest phases:",
                         "ci: STACK=26.08 cpu:    189.8 s tests/test_layout_matrix.py::test_cycle (setup)"]
    assert len(lines) == 8  # the summary, the workers, the four phases the log lists and the CPU lines
    ci_log = tmp_path / "ci.log"
    ci_log.write_text("noise\n" + run.stdout + "ci: all stacks: 2650 s of the 2700 s target (98 %)\n")
    table = subprocess.run([sys.executable, str(REPO / ".ci" / "report.py"), "table", str(ci_log)],
                           capture_output=True, text=True, check=True).stdout.splitlines()
    assert table[2] == "| `26.08` | -m stack | 22 s | 301 s | 374 passed, 1 failed, 2 skipped, 0 error |"
    assert table[3] == "| all | | 22 s | 301 s | 2650 s of the 2700 s target |"
    assert "- 207 s `tests/test_layout_matrix.py::test_cycle (setup)`" in table


def test_bad_arguments_are_one_line_and_exit_2():
    run = subprocess.run([sys.executable, str(REPO / ".ci" / "report.py"), "tabel"], capture_output=True, text=True)
    assert run.returncode == 2 and run.stdout == "" and run.stderr.count("\n") == 1 and "usage:" in run.stderr
