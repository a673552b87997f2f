"""Shared fixtures: CPU mode for tests that build or train Megatron models."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def cpu_mode():
    """Megatron Bridge on CPU for this test process (idempotent, process-wide)."""
    import torch

    from bridge_ext.cpu_mode import enable_cpu_mode

    enable_cpu_mode()
    torch.set_num_threads(1)  # tiny models: one thread is faster and steadier on a shared 2-core machine
    yield


def pytest_collection_modifyitems(config, items):
    """Tests marked ``heavy`` (minutes each) run first: pytest-xdist hands tests out in collection order, so a
    heavy test collected last would leave one worker running it alone at the end of the suite."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)
