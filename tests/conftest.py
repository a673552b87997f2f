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
