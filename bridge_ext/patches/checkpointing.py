"""Checkpointing patches (scope ``checkpointing``, applied by ``bridge_ext.training.run_pretrain``).

The behaviour they install is a feature of ours that lives with its feature module (and never imports this
package): the commit protocol of kill-safe saves in ``bridge_ext.kill_safe``, the optimizer load across
expert-parallel layouts in ``bridge_ext.relayout`` (only ``param-group-identity``'s pairing, a fix with no feature
of ours behind it, is here). What is replaced upstream, why, when, and the upstream code each relies on (matched
by content) is here.

* ``atomic-checkpoint-save`` and the four ``atomic-checkpoint-*`` rows, one per attribute: megatron-bridge 0.3
  ``training/checkpointing.py`` ``save_checkpoint`` writes the trackers before ``run_config.yaml`` and the
  tokenizer files: a run killed in between names an iteration it can never load. ``save_checkpoint`` (in every
  module that imported it by name) and the four helpers it calls are wrapped so that the trackers are staged in
  the iteration directory and moved into place once it is complete.
* ``checkpoint-writer-dies-with-trainer``: megatron-core ``dist_checkpointing/strategies/filesystem_async.py``
  ``_get_write_results_queue`` (0.17+: ``get_write_results_queue(mp_mode)``, one patch per name) starts a
  Manager server that outlives a trainer killed with SIGKILL.
* ``relayout-optimizer-load``: megatron-core ``dist_checkpointing.load`` merges the saved optimizer structure
  into the loading layout's: a resume with another expert-parallel size fails ("Cannot merge two lists"). Where
  ``load()`` reads the common state itself (megatron-core 0.17+), ``relayout-common-state`` (0.19:
  ``load_common_state_dict``; 0.17-0.18: ``load_common``) hands it this layout's structure for that load.
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
  Optimizer code, but what breaks is a resume: applied with the other checkpointing patches.
"""

from __future__ import annotations

import copy
import functools
import importlib
import sys
from collections.abc import Callable
from typing import Any

from bridge_ext.stack import UpstreamDrift, package_of
from bridge_ext.upstream_patch import Patch, one_of

__all__ = ["PATCHES", "groups_collide", "pair_param_groups"]

_CKPT = "megatron.bridge.training.checkpointing"
_SERIALIZATION = "megatron.core.dist_checkpointing.serialization"


def _rebind_save_checkpoint() -> None:
    """``save_checkpoint`` wrapped (``bridge_ext.kill_safe.atomic_save_checkpoint``) in every ``megatron.bridge``
    module that imported it by name (``training/train.py`` holds its own reference): one attribute, several
    holders, so an install rather than one ``setattr``."""
    from bridge_ext.kill_safe import atomic_save_checkpoint

    ckpt = importlib.import_module(_CKPT)
    importlib.import_module("megatron.bridge.training.train")  # holds its own reference to save_checkpoint
    original = ckpt.save_checkpoint
    wrapped = atomic_save_checkpoint(original)
    for module in list(sys.modules.values()):  # every module that imported the function by name
        if getattr(module, "__name__", "").startswith("megatron.bridge") and \
                getattr(module, "save_checkpoint", None) is original:
            module.save_checkpoint = wrapped


def _staged_tracker_filename(tracker: Callable) -> Callable:
    from bridge_ext.kill_safe import staged_tracker

    return functools.wraps(tracker)(lambda checkpoints_path: staged_tracker(tracker(checkpoints_path),
                                                                            checkpoints_path))


def _staged_train_state_filename(train_state: Callable) -> Callable:
    from bridge_ext.kill_safe import staged_tracker

    return functools.wraps(train_state)(
        lambda checkpoints_path, prefix=None: train_state(checkpoints_path, prefix=prefix) if prefix is None
        else staged_tracker(train_state(checkpoints_path, prefix=prefix), checkpoints_path))


def _commit_after_async_save(schedule: Callable) -> Callable:
    from bridge_ext.kill_safe import commit_after_async_save

    return commit_after_async_save(schedule)


def _deferred_cleanup(cleanup: Callable) -> Callable:
    from bridge_ext.kill_safe import deferred_cleanup

    return deferred_cleanup(cleanup)


def _load_reads_common_with(name: str) -> bool:
    """Whether the installed ``dist_checkpointing.load`` reads the saved common state through ``name``
    (serialization's ``load_common``: megatron-core 0.17-0.18; ``load_common_state_dict``: 0.19), not through a
    common strategy it is handed (0.16)."""
    import inspect

    serialization = importlib.import_module(_SERIALIZATION)
    return f"common_state_dict = {name}(checkpoint_dir)" in inspect.getsource(inspect.unwrap(serialization.load))


def _common_with_this_layouts_optimizer(load_common: Callable) -> Callable:
    from bridge_ext.relayout import common_with_this_layouts_optimizer

    return common_with_this_layouts_optimizer(load_common)


_WRITER = "megatron.core.dist_checkpointing.strategies.filesystem_async"


def _writer_keeps_a_manager(name: str = "_get_write_results_queue") -> bool:
    import inspect

    factory = getattr(importlib.import_module(_WRITER), name, None)
    return factory is not None and "Manager()" in inspect.getsource(inspect.unwrap(factory))


def _results_queue_with_our_server(factory: Callable) -> Callable:
    from bridge_ext.kill_safe import start_results_server

    @functools.wraps(factory)
    def results_queue(*args: Any, **kwargs: Any) -> Any:  # megatron-core 0.17+: mp_mode=
        start_results_server()
        return factory(*args, **kwargs)

    return results_queue


def _load_into_this_layout(load: Callable) -> Callable:
    from bridge_ext.relayout import load_into_this_layout

    wrapped = functools.partial(load_into_this_layout, load)
    return functools.update_wrapper(lambda *a, **k: wrapped(*a, **k), load)


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
                            "bridge_ext.patches.checkpointing needs updating") from None
    return [(g["max_lr"], g["params"]) for g in paired] != [(g["max_lr"], g["params"]) for g in current]


def _paired(old: Any) -> Any:
    function = getattr(old, "__func__", old)

    def _filter_and_reorder_param_groups(current_groups: list[dict], state_dict_groups: list[dict]) -> list[dict]:
        return pair_param_groups(current_groups, state_dict_groups)

    _filter_and_reorder_param_groups._bridge_ext_original = function  # type: ignore[attr-defined]
    return staticmethod(_filter_and_reorder_param_groups)


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="atomic-checkpoint-save", area="checkpointing", scope="checkpointing",
        module=_CKPT, attr="save_checkpoint",
        upstream="megatron/bridge/training/checkpointing.py save_checkpoint: trackers written before run_config.yaml",
        why="a run killed mid-save names an iteration it cannot load; the trackers, staged in the iteration "
            "directory by the atomic-checkpoint-* rows below, move into place once it is complete "
            "(bridge_ext.kill_safe); rebound in every megatron.bridge module that imported it by name",
        # what the wrapper relies on inside save_checkpoint (megatron-bridge 0.3.0 and 0.3.1 have them)
        snippets=("train_state_global_filename = get_checkpoint_train_state_filename(save_dir, prefix=TRACKER_PREFIX)",
                  "tracker_filename = get_checkpoint_tracker_filename(save_dir)",
                  "cfg.to_yaml(config_filename)"),
        install=_rebind_save_checkpoint,
    ),
    Patch(
        name="atomic-checkpoint-tracker", area="checkpointing", scope="checkpointing",
        module=_CKPT, attr="get_checkpoint_tracker_filename",
        upstream="megatron/bridge/training/checkpointing.py get_checkpoint_tracker_filename, called by "
                 "save_checkpoint for latest_checkpointed_iteration.txt",
        why="the tracker save_checkpoint writes goes to the iteration directory (staged), moved into place by "
            "atomic-checkpoint-save once the iteration is complete (bridge_ext.kill_safe.staged_tracker)",
        snippets=("tracker_filename = get_checkpoint_tracker_filename(save_dir)",),
        make=_staged_tracker_filename,
    ),
    Patch(
        name="atomic-checkpoint-train-state", area="checkpointing", scope="checkpointing",
        module=_CKPT, attr="get_checkpoint_train_state_filename",
        upstream="megatron/bridge/training/checkpointing.py get_checkpoint_train_state_filename, called by "
                 "save_checkpoint with prefix=TRACKER_PREFIX for latest_train_state.pt",
        why="the global train state (a tracker too) is staged like the tracker; the per-iteration one "
            "(no prefix) is left as it is (bridge_ext.kill_safe.staged_tracker)",
        snippets=("train_state_global_filename = get_checkpoint_train_state_filename(save_dir, prefix=TRACKER_PREFIX)",),
        make=_staged_train_state_filename,
    ),
    Patch(
        name="atomic-checkpoint-async-commit", area="checkpointing", scope="checkpointing",
        module=_CKPT, attr="schedule_async_save",
        upstream="megatron/bridge/training/checkpointing.py schedule_async_save: an async save's trackers are "
                 "written by its finalize functions",
        why="an async save's staged trackers move into place after its finalize functions ran, when the "
            "iteration is complete (bridge_ext.kill_safe.commit_after_async_save)",
        snippets=("async_save_request.add_finalize_fn(train_state_finalize_fn)",
                  "schedule_async_save(state, async_save_request)"),
        make=_commit_after_async_save,
    ),
    Patch(
        name="atomic-checkpoint-cleanup", area="checkpointing", scope="checkpointing",
        module=_CKPT, attr="cleanup_old_non_persistent_checkpoint",
        upstream="megatron/bridge/training/checkpointing.py cleanup_old_non_persistent_checkpoint, called by "
                 "save_checkpoint before the new iteration is complete",
        why="the old non-persistent iteration is removed only after the new one is committed: a run killed in "
            "between still has one it can load (bridge_ext.kill_safe.deferred_cleanup)",
        snippets=("cleanup_old_non_persistent_checkpoint(",),
        make=_deferred_cleanup,
    ),
    Patch(
        name="checkpoint-writer-dies-with-trainer", area="checkpointing", scope="checkpointing",
        module=_WRITER, attr="_get_write_results_queue",
        upstream="megatron/core/dist_checkpointing/strategies/filesystem_async.py _get_write_results_queue",
        why="its Manager server (and resource tracker) outlived a trainer killed with SIGKILL; ours is started "
            "with PR_SET_PDEATHSIG (bridge_ext.kill_safe.start_results_server)",
        when="the installed writer starts a Manager of its own",
        needed=_writer_keeps_a_manager,
        snippets=("_results_queue = None",),
        make=_results_queue_with_our_server,
    ),
    Patch(
        name="checkpoint-writer-dies-with-trainer (get_write_results_queue)", area="checkpointing",
        scope="checkpointing", module=_WRITER, attr="get_write_results_queue",
        upstream="megatron/core/dist_checkpointing/strategies/filesystem_async.py get_write_results_queue "
                 "(megatron-core 0.17+'s name; Megatron Bridge saves with async_strategy='mcore', this writer)",
        why="its Manager server (and resource tracker) outlived a trainer killed with SIGKILL; ours is started "
            "with PR_SET_PDEATHSIG (bridge_ext.kill_safe.start_results_server)",
        when="the installed writer's get_write_results_queue starts a Manager of its own",
        needed=lambda: _writer_keeps_a_manager("get_write_results_queue"),
        snippets=("_results_queue = None", "self.results_queue = get_write_results_queue()"),
        make=_results_queue_with_our_server,
    ),
    Patch(
        name="relayout-optimizer-load", area="checkpointing", scope="checkpointing",
        module="megatron.core.dist_checkpointing", attr="load",
        upstream="megatron/core/dist_checkpointing/serialization.py load: merge(common_state_dict, loaded_state_dict)",
        why="a resume with another expert-parallel size merges the saved optimizer structure into a different one "
            "(\"Cannot merge two lists\"); loaded into this layout's structure instead (bridge_ext.relayout)",
        when="always (only loads whose saved optimizer structure differs are changed)",
        elsewhere=(
            # the common (non-tensor) state is the base the loaded tensors are merged into: read by load()'s
            # common strategy (megatron-core 0.16), load_common (0.17) or load_common_state_dict (0.19: no
            # common_strategy argument)
            ("megatron.core.dist_checkpointing.serialization",
             (one_of("common_state_dict = common_strategy.load_common(checkpoint_dir)",
                     "common_state_dict = load_common(checkpoint_dir)",
                     "common_state_dict = load_common_state_dict(checkpoint_dir)"),
              "merge(common_state_dict, loaded_state_dict)")),
            # Megatron Bridge loads through the package attribute; rng_state's sharding follows EP; TP/PP check
            (_CKPT, ("state_dict = dist_checkpointing.load(", "if ep_size > 1:", "(TP, PP) mismatch after resume",
                     "and cfg.checkpoint.load_rng")),
            # EP>1 gives the expert weights their own optimizer member / param groups: Muon's in muon.py
            # (megatron-core 0.16) or, where muon.py is a shim, in optimizer/__init__.py (0.19)
            ("megatron.core.optimizer.muon", (one_of("if group['is_expert_parallel']:",
                                                     "Backward-compatible shim — all code now lives in"),)),
            ("megatron.core.optimizer", ("is_expert_parallel = not getattr(param, 'allreduce', True)",)),
        ),
        make=_load_into_this_layout,
    ),
    Patch(
        name="relayout-common-state", area="checkpointing", scope="checkpointing",
        module=_SERIALIZATION, attr="load_common_state_dict",
        upstream="megatron/core/dist_checkpointing/serialization.py load -> load_common_state_dict (megatron-core "
                 "0.19: load() takes no common strategy)",
        why="relayout-optimizer-load's load merges the tensors into this layout's optimizer structure; where load() "
            "reads the saved common state through this function, it returns that structure for that load "
            "(bridge_ext.relayout.common_with_this_layouts_optimizer; upstream's value for every other call)",
        when="the installed load() reads the common state through load_common_state_dict",
        needed=lambda: _load_reads_common_with("load_common_state_dict"),
        snippets=("common_state_dict = load_common_state_dict(checkpoint_dir)",
                  "merge(common_state_dict, loaded_state_dict)"),
        make=_common_with_this_layouts_optimizer,
    ),
    Patch(
        name="relayout-common-state (load_common)", area="checkpointing", scope="checkpointing",
        module=_SERIALIZATION, attr="load_common",
        upstream="megatron/core/dist_checkpointing/serialization.py load -> load_common (megatron-core 0.17-0.18, "
                 "imported from strategies/common.py)",
        why="relayout-optimizer-load's load merges the tensors into this layout's optimizer structure; where load() "
            "reads the saved common state through load_common, it returns that structure for that load "
            "(bridge_ext.relayout.common_with_this_layouts_optimizer; upstream's value for every other call)",
        when="the installed load() reads the common state through load_common",
        needed=lambda: _load_reads_common_with("load_common"),
        snippets=("common_state_dict = load_common(checkpoint_dir)", "merge(common_state_dict, loaded_state_dict)"),
        make=_common_with_this_layouts_optimizer,
    ),
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
