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
