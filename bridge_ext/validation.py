"""Validating a GPU recipe on a machine without its GPU or without Transformer Engine (``--dryrun``, ``plan``, every
``nemo llm pretrain`` before it runs): what ``ConfigContainer.validate()`` checks about *this* machine is set aside,
everything about the target still runs. Not part of CPU mode: a GPU run validates through it too (it then changes
nothing).
"""

from __future__ import annotations

import contextlib
from typing import Any

from bridge_ext.stack import have_transformer_engine
from bridge_ext import upstream_patch

__all__ = ["TE_KERNEL_FLAGS", "validation_without_gpu"]


# Provider flags whose validation only checks that Transformer Engine kernels import on *this* machine:
# megatron/core/transformer/transformer_config.py:1834 (megatron-core 0.16.1) for moe_permute_fusion.
TE_KERNEL_FLAGS = ("moe_permute_fusion",)


@contextlib.contextmanager
def validation_without_gpu(cfg: Any):
    """Run ``ConfigContainer.validate()`` for a GPU target on a machine that lacks the GPU or TE.

    - ``megatron/bridge/training/config.py``: ``ConfigContainer.validate()`` ends with
      ``validate_flex_dispatcher_backend`` (``training/flex_dispatcher_backend.py``), which reads
      ``torch.cuda.get_device_properties(0)``: skipped when no GPU is visible (patch ``validate-without-gpu``).
    - TE-kernel flags (``TE_KERNEL_FLAGS``) are turned off on ``cfg`` (a copy being validated) when TE is
      absent: their check says whether TE is installed here, nothing about the target.
    Everything else ``validate()`` checks still runs.
    """
    if not have_transformer_engine():
        for flag in TE_KERNEL_FLAGS:
            setattr(cfg.model, flag, False)
    with upstream_patch.temporarily("dryrun"):  # validate-without-gpu
        yield
