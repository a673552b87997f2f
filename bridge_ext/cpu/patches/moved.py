"""CPU mode's CUDA redirects for code that releases keep in different places (``MOVED``).

Each block of CUDA code has its homes, one per release line, each recognized by content (:class:`Home`): the
block's redirect applies in the first home whose code the installed release has. A home may be ``cpu_safe``
(that release's code falls back to the CPU itself, or no longer exists: nothing to redirect). A release that
keeps the block in none of its homes is drift (one line naming the block and the homes looked in).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from bridge_ext.cpu.patches.redirect import TorchOnCPU, real_torch, torch_proxy
from bridge_ext.stack import UpstreamDrift, missing_snippets, package_of
from bridge_ext.upstream_patch import Patch, Snippet, one_of

__all__ = ["MOVED", "Home", "PATCHES"]


@dataclass(frozen=True, kw_only=True)
class Home:
    """Where a release keeps a block: ``module``, recognized by its ``snippets`` (all occur; ``absent``: none
    occurs, the code was removed). ``cpu_safe``: nothing to redirect there. ``release``: which releases, in words."""

    module: str
    snippets: tuple[Snippet, ...]
    release: str
    cpu_safe: bool = False
    absent: bool = False


MOVED: dict[str, tuple[Home, ...]] = {
    # Megatron Bridge wraps the model in DDP on a dedicated CUDA stream
    "the DDP wrapping's stream": (
        Home(module="megatron.bridge.models.model_provider", release="megatron-bridge 0.3 (model_provider.py)",
             snippets=('ddp_stream = torch.cuda.Stream()', 'ddp_stream.wait_stream(torch.cuda.current_stream())',
                       'with torch.cuda.stream(ddp_stream):', 'torch.cuda.current_stream().wait_stream(ddp_stream)')),
        # megatron-bridge 0.4 model_provider.py imports _ddp_wrap from models/common/unimodal.py, which holds it
        Home(module="megatron.bridge.models.common.unimodal", release="megatron-bridge 0.4 (unimodal.py _ddp_wrap)",
             snippets=('ddp_stream = torch.cuda.Stream()', 'ddp_stream.wait_stream(torch.cuda.current_stream())',
                       'with torch.cuda.stream(ddp_stream):', 'torch.cuda.current_stream().wait_stream(ddp_stream)')),
        # megatron-bridge 0.6 model_provider.py imports _ddp_wrap from models/common/unimodal.py, which
        # re-exports megatron-core 0.19's megatron/training/models/dist_utils.py
        Home(module="megatron.training.models.dist_utils", release="megatron-core 0.19 (_ddp_wrap)",
             snippets=('ddp_stream = torch.cuda.Stream()', 'ddp_stream.wait_stream(torch.cuda.current_stream())',
                       'with torch.cuda.stream(ddp_stream):', 'torch.cuda.current_stream().wait_stream(ddp_stream)')),
    ),
    # the router's aux-loss tracker allocates its per-layer values on the GPU
    "the MoE aux-loss tracker": (
        Home(module="megatron.core.transformer.moe.moe_utils", release="megatron-core 0.16-0.17 (moe_utils.py)",
             snippets=(one_of('tracker[key]["values"] = torch.zeros(num_layers, device="cuda")',
                              'tracker[key]["values"] = torch.zeros(tracker_num_layers, device="cuda")'),)),  # 0.17
        # megatron-core 0.19: get_moe_metrics_tracker() (moe_logging.py) allocates on the value's device, or
        # on the CPU when no GPU is available
        Home(module="megatron.core.transformer.moe.moe_logging", release="megatron-core 0.19 (moe_logging.py)",
             snippets=('def get_moe_metrics_tracker()',
                       'device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"',
                       'values=torch.zeros(num_layers, device=value.device)'),
             cpu_safe=True),
    ),
}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its package is not installed either
        return False


def _holds(home: Home) -> bool:
    if not _importable(home.module):
        return False
    missing = missing_snippets(home.module, home.snippets)
    return not missing if not home.absent else len(missing) == len(home.snippets)


def _home_of(block: str) -> Home:
    """The home of ``block`` in the installed release (the first that holds it); drift when none does."""
    homes = MOVED[block]
    found = next((home for home in homes if _holds(home)), None)
    if found is None:
        raise UpstreamDrift(f"{package_of(homes[-1].module)}: CPU mode finds {block} in none of "
                            f"{', '.join(sorted({h.module for h in homes}))}; bridge_ext.cpu.patches.moved needs "
                            "updating")
    return found


def _redirect(block: str, home: Home) -> Patch:
    return Patch(
        name=f"cuda-on-cpu {home.module} ({block})", area="cpu", scope="cpu", module=home.module, attr="torch",
        upstream=f"{home.module.replace('.', '/')}.py: {block}, torch.cuda.* calls ({home.release})",
        why="torch.cuda / device='cuda' -> CPU",
        when=f"CPU mode, where the installed release keeps {block} there (matched by content; elsewhere: "
             + "; ".join(f"{h.release}: {'nothing to redirect' if h.cpu_safe else h.module}"
                         for h in MOVED[block] if h is not home) + ")",
        needed=lambda: _home_of(block) is home,
        snippets=home.snippets,
        accepts=lambda value: value is real_torch() or isinstance(value, TorchOnCPU),
        make=lambda old: torch_proxy(False),
    )


PATCHES: tuple[Patch, ...] = tuple(_redirect(block, home) for block, homes in MOVED.items() for home in homes
                                   if not home.cpu_safe)
