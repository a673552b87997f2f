"""Shared fixtures: CPU mode for tests that build or train Megatron models; the `nemo` command in this process."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from tests.nemo_cli import call_nemo

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def cpu_mode():
    """Megatron Bridge on CPU for this test process (idempotent, process-wide)."""
    import torch

    from bridge_ext.cpu import enable_cpu_mode

    enable_cpu_mode()
    torch.set_num_threads(1)  # tiny models: one thread is faster and steadier on a shared 2-core machine
    yield


@pytest.fixture
def nemo(request):
    """``nemo(argv, cwd=None, env=None) -> Result(code, stdout, stderr)``: the command in this process
    (tests/nemo_cli.py), its output through the test's ``capsys`` where it uses that, else ``capfd``."""
    capture = request.getfixturevalue("capsys" if "capsys" in request.fixturenames else "capfd")
    return functools.partial(call_nemo, capture=capture)


def pytest_collection_modifyitems(config, items):
    """Modules in the order their cost suggests: those holding a ``heavy`` or ``matrix`` test (minutes each) first,
    then those holding a ``slow`` one, then the rest, each module's tests kept together and in their order.
    ``make test`` hands out whole modules (pytest-xdist's ``--dist loadfile``: a module's fixtures are made once),
    the next to the first worker that is nearly done: longest first, so both workers end together. (Before, the
    default ``load`` scheduler sent the first quarter of the suite, every heavy test, to one worker, which ran
    them one after the other for ~7 minutes after the other worker had run out: docs/testing.md.)"""
    def cost_class(item) -> int:
        if any(item.get_closest_marker(name) for name in ("heavy", "matrix")):
            return 0
        return 1 if item.get_closest_marker("slow") else 2

    module_class: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        module_class[module] = min(cost_class(item), module_class.get(module, 2))
    items.sort(key=lambda item: module_class[item.nodeid.split("::")[0]])  # stable: modules stay in their order


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real Slurm cluster on this machine (tests/slurm/cluster.sh: two nodes, partition ``cpu``), up while any
    test process of the session uses it: the first user starts it, the last one stops it (a file lock and a
    count, for pytest-xdist's workers). Yields the environment that points Slurm's commands at it."""
    import os
    import subprocess

    from filelock import FileLock

    script = ROOT / "tests" / "slurm" / "cluster.sh"
    state = Path(os.environ.get("SLURM_TEST_DIR", "/tmp/bridge-ext-slurm"))
    state.mkdir(parents=True, exist_ok=True)
    users = state / "pytest-users"

    def count(delta: int) -> int:
        value = max(0, int(users.read_text() or 0) if users.exists() else 0) + delta
        users.write_text(str(value))
        return value

    with FileLock(str(state / "pytest.lock")):
        count(+1)
        up = subprocess.run([script, "up"], capture_output=True, text=True)  # idempotent: a cluster that is up stays
        if up.returncode != 0:
            count(-1)
            pytest.fail(f"the test Slurm cluster did not come up: {up.stderr.strip()}", pytrace=False)
    try:
        yield {"SLURM_CONF": str(state / "slurm.conf")}
    finally:
        with FileLock(str(state / "pytest.lock")):
            if count(-1) == 0:
                subprocess.run([script, "down"], capture_output=True, text=True)


@pytest.fixture(scope="module")
def one_process_model_parallel(cpu_mode):
    """A one-process gloo group and megatron-core's model-parallel state (TP1) for building layers and specs in
    this process; both are torn down after the module where this fixture made them (a rehearsal later in the same
    xdist worker makes its own process group)."""
    import torch
    from megatron.core import parallel_state

    from bridge_ext.process_state import init_single_process_distributed

    group_was_there = torch.distributed.is_initialized()
    init_single_process_distributed()
    ours = not parallel_state.model_parallel_is_initialized()
    if ours:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    yield parallel_state
    if ours:
        parallel_state.destroy_model_parallel()
    if not group_was_there:
        torch.distributed.destroy_process_group()


_WORKER_SPANS: dict[str, list[float]] = {}  # worker -> [first test's start, last test's stop] (epoch seconds)
_CPU: dict[str, float] = {}  # "nodeid (phase)" -> CPU seconds
_cpu_mark = [0.0]  # this process's CPU seconds at its last report


def _cpu_seconds() -> float:
    """This process's CPU seconds and those of the children it waited for (a test's subprocesses and launches;
    not a Slurm job's, which slurmd runs)."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's CPU seconds on its report: on a saturated 2-core machine, what a test costs."""
    outcome = yield
    now = _cpu_seconds()
    outcome.get_result().user_properties.append(("cpu_s", now - _cpu_mark[0]))
    _cpu_mark[0] = now


def pytest_collection_finish(session):
    _cpu_mark[0] = _cpu_seconds()  # the imports of collection are not the first test's


def pytest_runtest_logreport(report):
    """Each worker's span and each phase's CPU seconds, as the controller receives the reports (pytest-xdist
    names the worker in ``report.node``): the summary's ``workers:`` line shows how long one worker ran alone at
    the end, its ``cpu:`` lines the costliest phases."""
    gateway = getattr(getattr(report, "node", None), "gateway", None)
    span = _WORKER_SPANS.setdefault(gateway.id if gateway else "main", [report.start, report.stop])
    span[0], span[1] = min(span[0], report.start), max(span[1], report.stop)
    cpu = dict(report.user_properties).get("cpu_s")
    if cpu is not None:
        _CPU[report.nodeid if report.when == "call" else f"{report.nodeid} ({report.when})"] = cpu


def pytest_terminal_summary(terminalreporter):
    if _CPU and terminalreporter.config.getoption("durations") is not None:  # with --durations (make test, CI)
        terminalreporter.write_line(f"cpu: {sum(_CPU.values()):.0f} s in all; the 15 costliest phases:")
        for seconds, phase in sorted(((s, p) for p, s in _CPU.items()), reverse=True)[:15]:
            terminalreporter.write_line(f"cpu: {seconds:8.1f} s {phase}")
    if len(_WORKER_SPANS) < 2:
        return
    start = min(first for first, _ in _WORKER_SPANS.values())
    ends = sorted((last - start, name) for name, (_, last) in _WORKER_SPANS.items())
    terminalreporter.write_line("workers: " + ", ".join(f"{name} ended at {end:.0f} s" for end, name in ends)
                                + f"; the last ran alone for {ends[-1][0] - ends[-2][0]:.0f} s")
