"""Shared fixtures: CPU mode for tests that build or train Megatron models; the `nemo` command in this process."""

from __future__ import annotations

import functools

import pytest

from tests.nemo_cli import call_nemo


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
    """Tests marked ``heavy`` or ``matrix`` (minutes each) run first: pytest-xdist hands tests out in collection
    order, so such a test collected last would leave one worker running it alone at the end of the suite."""
    items.sort(key=lambda item: not any(item.get_closest_marker(name) for name in ("heavy", "matrix")))
