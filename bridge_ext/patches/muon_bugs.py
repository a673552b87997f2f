"""Known upstream bugs of layer-wise Muon runs beyond QK-clip (tests/test_upstream_muon_bugs.py).

Patch (scope ``checkpointing``, applied by ``bridge_ext.training.run_pretrain``):

* ``param-group-identity`` (Megatron-LM issue 2625): megatron-core ``optimizer/optimizer.py``
  ``MegatronOptimizer._filter_and_reorder_param_groups`` pairs each param group of a loaded checkpoint with the
  optimizer's by ``param_group_identifier_keys`` (0.16-0.18: wd_mult, lr_mult, is_expert_parallel,
  is_decoupled_lr), a dict keyed by that tuple. Groups that differ only by another override value (Megatron
  Bridge's ``optimizer.decoupled_lr`` sets ``max_lr`` for the embedding and output layer, next to the default
  group) collapse into one: the load fails ("loaded state dict contains a parameter group that doesn't match
  the size of optimizer's group", measured with ``dist_muon`` on PP2 and DP2) or, with equal sizes, resumes
  with another group's learning rate. The patched function pairs groups by position where the identifiers
  agree there (the order both sides were built in), else as upstream; every pair is a group of its own.
  Applies where the installed function, on two groups that differ only by ``max_lr``, gives one of them the
  other's (megatron-core 0.16-0.18; 0.19 adds every override key to the identifier).

The launch checks for layer-wise Muon (Megatron-Bridge issue 2307, Megatron-LM issue 2164) are
``bridge_ext.muon.checks``.
"""

from __future__ import annotations

import copy
import importlib
from typing import Any

from bridge_ext.patches.core import Patch
from bridge_ext.stack import UpstreamDrift, package_of

__all__ = ["PATCHES", "groups_collide", "pair_param_groups"]

_OPT = "megatron.core.optimizer.optimizer"


def _identifier(group: dict, keys: tuple[str, ...]) -> tuple:
    # NeMo names wd_mult/lr_mult pre_wd_mult/pre_lr_mult (as upstream reads them)
    return tuple(group[key] if key in group else group.get(f"pre_{key}") for key in keys)


def pair_param_groups(current_groups: list[dict], state_dict_groups: list[dict]) -> list[dict]:
    """Loaded param groups in the current optimizer's order, one per current group (see the module docstring).

    As upstream: a current group takes the hyperparameters of a loaded group with its identifier and the
    ``params`` at its own position; the loaded group at the same position when its identifier agrees, else
    the first one not taken yet (upstream: the last of them, for every current group with that identifier).
    """
    keys = tuple(importlib.import_module(_OPT).param_group_identifier_keys)
    params = [group["params"] for group in state_dict_groups]
    taken: set[int] = set()
    out = []
    for index, (group, group_params) in enumerate(zip(current_groups, params)):
        key = _identifier(group, keys)
        same = [i for i, saved in enumerate(state_dict_groups) if i not in taken and _identifier(saved, keys) == key]
        if not same:
            available = "\n".join(str(_identifier(g, keys)) for g in state_dict_groups)
            raise ValueError(f"Could not find parameter group with key {key} in loaded checkpoint.\n"
                             f"Available keys:\n{available}\nParameter group key definition: {keys}")
        chosen = index if index in same else same[0]
        taken.add(chosen)
        out.append({**state_dict_groups[chosen], "params": group_params})
    return out


def _probe_groups() -> tuple[list[dict], list[dict]]:
    """Megatron Bridge's default group and its decoupled-lr group: equal but for max_lr."""
    base = {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False,
            "min_lr": 0.0, "default_config": True}
    current = [{**base, "params": [0], "max_lr": 1e-3}, {**base, "params": [1, 2], "max_lr": 2e-2,
                                                          "default_config": False}]
    return current, copy.deepcopy(current)


def _upstream_filter() -> Any:
    function = importlib.import_module(_OPT).MegatronOptimizer.__dict__.get("_filter_and_reorder_param_groups")
    function = getattr(function, "__func__", function)
    return getattr(function, "_bridge_ext_original", function)


def groups_collide() -> bool:
    """Whether the installed ``_filter_and_reorder_param_groups`` gives one of two groups that differ only by
    ``max_lr`` the other's hyperparameters."""
    current, saved = _probe_groups()
    try:
        paired = _upstream_filter()(copy.deepcopy(current), saved)
    except ValueError:
        return True
    except Exception as exc:  # noqa: BLE001 - a changed signature or shape: the probe no longer fits
        raise UpstreamDrift(f"{package_of(_OPT)}: MegatronOptimizer._filter_and_reorder_param_groups no longer "
                            f"runs on bridge_ext's probe ({type(exc).__name__}: {exc}); "
                            "bridge_ext.patches.muon_bugs needs updating") from None
    return [(g["max_lr"], g["params"]) for g in paired] != [(g["max_lr"], g["params"]) for g in current]


def _paired(old: Any) -> Any:
    function = getattr(old, "__func__", old)

    def _filter_and_reorder_param_groups(current_groups: list[dict], state_dict_groups: list[dict]) -> list[dict]:
        return pair_param_groups(current_groups, state_dict_groups)

    _filter_and_reorder_param_groups._bridge_ext_original = function  # type: ignore[attr-defined]
    return staticmethod(_filter_and_reorder_param_groups)


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="param-group-identity", area="checkpointing", scope="checkpointing", module=_OPT,
        attr="MegatronOptimizer._filter_and_reorder_param_groups",
        upstream="megatron/core/optimizer/optimizer.py MegatronOptimizer._filter_and_reorder_param_groups "
                 "(Megatron-LM issue 2625)",
        why="loaded param groups are matched by (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr); groups "
            "that differ only by an override value (decoupled_lr's max_lr) collapse into one: the load fails or "
            "a group resumes with another's learning rate; paired by position where identifiers agree",
        when="the installed function, on two groups that differ only by max_lr, gives one the other's",
        needed=groups_collide,
        snippets=("param_group_identifier_keys",),
        accepts=lambda value: isinstance(value, staticmethod)
        and not hasattr(value.__func__, "_bridge_ext_original"),
        make=_paired,
    ),
)

