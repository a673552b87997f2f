"""Checkpointing patches (scope ``checkpointing``, applied by ``bridge_ext.training.run_pretrain``).

The behaviour they install is a feature of ours that lives with its feature module (and never imports this
package): the commit protocol of kill-safe saves in ``bridge_ext.kill_safe``, the optimizer load across
expert-parallel layouts in ``bridge_ext.relayout``. What is replaced upstream, why, when, and the upstream code
each relies on (matched by content) is here.

* ``atomic-checkpoint-save``: megatron-bridge 0.3 ``training/checkpointing.py`` ``save_checkpoint`` writes the
  trackers before ``run_config.yaml`` and the tokenizer files: a run killed in between names an iteration it
  can never load. Every module's reference to ``save_checkpoint`` and the three helpers it calls are wrapped
  so that the trackers are staged in the iteration directory and moved into place once it is complete.
* ``checkpoint-writer-dies-with-trainer``: megatron-core ``dist_checkpointing/strategies/filesystem_async.py``
  ``_get_write_results_queue`` (0.17+: ``get_write_results_queue(mp_mode)``, one patch per name) starts a
  Manager server that outlives a trainer killed with SIGKILL.
* ``relayout-optimizer-load``: megatron-core ``dist_checkpointing.load`` merges the saved optimizer structure
  into the loading layout's: a resume with another expert-parallel size fails ("Cannot merge two lists").
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from typing import Any

from bridge_ext.patches.core import Patch, one_of

__all__ = ["PATCHES"]

_CKPT = "megatron.bridge.training.checkpointing"


def _install_atomic_save() -> None:
    from bridge_ext.kill_safe import atomic_save_checkpoint, commit_after_async_save, deferred_cleanup, staged_tracker

    ckpt = importlib.import_module(_CKPT)
    importlib.import_module("megatron.bridge.training.train")  # holds its own reference to save_checkpoint
    original = ckpt.save_checkpoint
    wrapped = atomic_save_checkpoint(original)
    for module in list(sys.modules.values()):  # every module that imported the function by name
        if getattr(module, "__name__", "").startswith("megatron.bridge") and \
                getattr(module, "save_checkpoint", None) is original:
            module.save_checkpoint = wrapped
    tracker, train_state = ckpt.get_checkpoint_tracker_filename, ckpt.get_checkpoint_train_state_filename
    ckpt.get_checkpoint_tracker_filename = functools.wraps(tracker)(
        lambda checkpoints_path: staged_tracker(tracker(checkpoints_path), checkpoints_path))
    ckpt.get_checkpoint_train_state_filename = functools.wraps(train_state)(
        lambda checkpoints_path, prefix=None: train_state(checkpoints_path, prefix=prefix) if prefix is None
        else staged_tracker(train_state(checkpoints_path, prefix=prefix), checkpoints_path))
    ckpt.schedule_async_save = commit_after_async_save(ckpt.schedule_async_save)
    ckpt.cleanup_old_non_persistent_checkpoint = deferred_cleanup(ckpt.cleanup_old_non_persistent_checkpoint)


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


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="atomic-checkpoint-save", area="checkpointing", scope="checkpointing",
        module=_CKPT, attr="save_checkpoint",
        upstream="megatron/bridge/training/checkpointing.py save_checkpoint: trackers written before run_config.yaml",
        why="a run killed mid-save names an iteration it cannot load; the trackers now move into place last "
            "(bridge_ext.kill_safe), also get_checkpoint_*_filename, schedule_async_save, cleanup_old_*",
        # what the wrapper relies on inside save_checkpoint (megatron-bridge 0.3.0 and 0.3.1 have them)
        snippets=("train_state_global_filename = get_checkpoint_train_state_filename(save_dir, prefix=TRACKER_PREFIX)",
                  "tracker_filename = get_checkpoint_tracker_filename(save_dir)",
                  "cfg.to_yaml(config_filename)",
                  "async_save_request.add_finalize_fn(train_state_finalize_fn)",
                  "schedule_async_save(state, async_save_request)",
                  "cleanup_old_non_persistent_checkpoint("),
        install=_install_atomic_save,
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
)
