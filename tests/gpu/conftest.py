"""The GPU tier (marker ``gpu``): skipped where no GPU is visible, so CI's CPU stacks collect and skip it.

Run on a GPU machine after ``bench/gpu_check.sh`` (docs/launch.md): ``GPU_CHECK_RESULTS=runs/gpu/gpu_check.json
python -m pytest tests/gpu -m gpu`` checks that run's numbers; without ``GPU_CHECK_RESULTS`` the tests run the
check's steps themselves (a few minutes).
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="GPU tier: no GPU visible (bench/gpu_check.sh on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
