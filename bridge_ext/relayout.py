"""Resuming a torch_dist checkpoint in another parallel layout (TP, PP, EP, DP), on GPUs and on CPU.

Megatron saves model weights and optimizer tensors under layout-independent keys (Megatron Bridge sets
``chained_optim_avoid_prefix``), so most layout changes load as they are. Two parts of a checkpoint follow
the layout and break a resume where the expert-parallel size changes (Megatron-LM/Megatron Bridge issue
reports: resuming or exporting an EP>1 checkpoint elsewhere):

- **The optimizer's structure.** With EP>1 the expert weights are not all-reduced (``allreduce=False``),
  so megatron-core builds them their own param groups and, for Muon and AdamW, their own chained optimizer
  member: EP1 -> [muon, adam], EP2 -> [muon, muon (experts), adam]. The non-tensor part of the optimizer
  state (param groups, Adam's step) is saved in ``common.pt`` in the saving layout's structure, and
  ``dist_checkpointing.load`` merges it into the loading layout's: "Cannot merge two lists with different
  lengths" (``dist_checkpointing/dict_utils.py``). :func:`load_into_this_layout` (installed over
  ``dist_checkpointing.load`` by the ``relayout-optimizer-load`` patch; from megatron-core 0.17, where ``load()``
  reads the common state itself, :func:`common_with_this_layouts_optimizer` over what it reads it with, by the
  ``relayout-common-state`` patches) loads the optimizer state into the
  *loading* layout's structure: the common part is what this layout would have
  saved (its param groups), the tensors load by key as always (so they reshard), and the one saved
  non-tensor value a resume needs is carried over: Adam's step (``common_step``). Learning rate and
  weight decay come from the scheduler's state, which loads as before.
- **The RNG state.** With EP>1 Megatron Bridge shards ``rng_state`` over (PP, TP, DP), else over (PP, TP), and
  its layout check compares only TP and PP (``training/checkpointing.py``): the shapes disagree.
  :func:`prepare` turns ``checkpoint.load_rng`` off for such a resume (as Megatron Bridge does for a TP/PP
  change: a new layout draws new per-rank RNG streams) and says so.

Each upstream spot the load relies on is matched by content (the patch's snippets in
``bridge_ext.patches.checkpointing``; tests/test_patches.py checks them on every stack).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from bridge_ext.runtime import is_rank_zero, read_yaml

__all__ = ["common_with_this_layouts_optimizer", "load_into_this_layout", "prepare"]

# The optimizer common state of the load in progress (load_into_this_layout), read by the wrapped load_common.
_THIS_LAYOUTS_OPTIMIZER: ContextVar[Any] = ContextVar("this_layouts_optimizer", default=None)


def _param_group_shape(tree: Any, path: tuple = ()) -> list[tuple[tuple, int]]:
    """(path, length) of every ``param_groups`` list in an optimizer state tree: its structure."""
    out: list[tuple[tuple, int]] = []
    if isinstance(tree, dict):
        for key, value in tree.items():
            if key == "param_groups" and isinstance(value, list):
                out.append(((*path, key), len(value)))
            else:
                out += _param_group_shape(value, (*path, key))
    elif isinstance(tree, list):
        for index, value in enumerate(tree):
            out += _param_group_shape(value, (*path, index))
    return sorted(out, key=repr)


def _torch_optimizer_states(tree: Any) -> list[dict]:
    """Every torch optimizer state dict (``{'state', 'param_groups'}``; a common part may lack ``state``) inside
    a (chained) optimizer tree."""
    if isinstance(tree, dict):
        if "param_groups" in tree:
            return [tree]
        return [found for value in tree.values() for found in _torch_optimizer_states(value)]
    if isinstance(tree, list):
        return [found for value in tree for found in _torch_optimizer_states(value)]
    return []


class _CommonWithOptimizer:
    """A load-common strategy whose ``load_common`` returns the checkpoint's common state with ``optimizer``
    replaced by the loading layout's own (what this layout would have saved there), step carried over."""

    def __init__(self, inner: Any, optimizer: Any):
        self._inner, self._optimizer = inner, optimizer

    def load_common(self, checkpoint_dir: Any) -> Any:
        common = self._inner.load_common(checkpoint_dir)
        common["optimizer"] = self._optimizer
        return common

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def load_into_this_layout(original: Any, sharded_state_dict: Any, checkpoint_dir: Any, *args: Any,
                          **kwargs: Any) -> Any:
    """``dist_checkpointing.load`` (``original``) that loads the optimizer state into the loading layout's
    structure; every other load goes to upstream's function unchanged."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase, ShardedTensorFactory

    requested = sharded_state_dict.get("optimizer") if isinstance(sharded_state_dict, dict) else None
    if requested is None or len(args) > 1 or kwargs.get("common_strategy") is not None:
        return original(sharded_state_dict, checkpoint_dir, *args, **kwargs)
    saved = dist_checkpointing.load_common_state_dict(checkpoint_dir).get("optimizer")
    if saved is None or _param_group_shape(saved) == _param_group_shape(requested):
        return original(sharded_state_dict, checkpoint_dir, *args, **kwargs)
    # What this layout saves in common.pt for its optimizer (dist_checkpointing's save_preprocess: everything
    # but sharded tensors, factories and non-persistent objects); the tensors load by key as usual.
    _, rebuilt = extract_matching_values(
        requested, lambda v: isinstance(v, (ShardedBase, ShardedTensorFactory, LocalNonpersistentObject)))
    steps = [s["state"]["common_step"] for s in _torch_optimizer_states(saved)
             if isinstance(s.get("state"), dict) and "common_step" in s["state"]]
    if steps:  # Adam's step (the same in every chained member: ChainedOptimizer._synchronize_steps)
        for state in _torch_optimizer_states(rebuilt):
            if any("betas" in group for group in state["param_groups"]):
                if not isinstance(state.get("state"), dict):
                    state["state"] = {}
                state["state"]["common_step"] = steps[0]
    load_source = inspect.getsource(inspect.unwrap(original))
    if "common_strategy.load_common(" in load_source:  # megatron-core 0.16 (0.17 keeps the argument, must be None)
        from megatron.core.dist_checkpointing.validation import verify_checkpoint_and_load_strategy

        _, common_strategy = verify_checkpoint_and_load_strategy(checkpoint_dir)
        kwargs["common_strategy"] = _CommonWithOptimizer(common_strategy, rebuilt)
        return original(sharded_state_dict, checkpoint_dir, *args, **kwargs)
    # megatron-core 0.17+: load() takes no common strategy (0.19 has no verify_checkpoint_and_load_strategy
    # either); it reads the common state through serialization.load_common (0.17) or load_common_state_dict
    # (0.19), which the relayout-common-state rows wrap (common_with_this_layouts_optimizer): for this load they
    # return this layout's optimizer structure
    token = _THIS_LAYOUTS_OPTIMIZER.set(rebuilt)
    try:
        return original(sharded_state_dict, checkpoint_dir, *args, **kwargs)
    finally:
        _THIS_LAYOUTS_OPTIMIZER.reset(token)


def common_with_this_layouts_optimizer(load_common: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """megatron-core's ``load_common`` / ``load_common_state_dict`` (``serialization``, what ``load()`` reads the
    common state with from 0.17), returning the common state with ``optimizer`` replaced by the loading layout's
    own inside :func:`load_into_this_layout`'s load; upstream's value everywhere else."""
    @functools.wraps(load_common)
    def load_common_state_dict(checkpoint_dir: Any) -> Any:
        common = load_common(checkpoint_dir)
        rebuilt = _THIS_LAYOUTS_OPTIMIZER.get()
        if rebuilt is not None:
            common["optimizer"] = rebuilt
        return common

    return load_common_state_dict


def _expert_parallel(model: dict) -> int:
    return int(model.get("expert_model_parallel_size") or 1)


def _refuse_distributed_optimizer_state(cfg: Any, saved: dict, where: str) -> None:
    """Distributed-optimizer state a resume cannot load: one line before any work (else a KeyError deep in the
    load, or Megatron Bridge's RuntimeError, as a traceback).

    - Into an optimizer that is not distributed (CPU mode turns it off on one process): the saved state has no
      per-parameter ``step`` (torch's Adam ``__setstate__``: KeyError 'step'; measured with the
      ``fully_reshardable`` format), and the default format's tensors are not per parameter at all.
    - Megatron Bridge's default format ``dp_reshardable`` (the optimizer's flat buckets,
      ``optimizer.distributed.*``) at another TP or PP: megatron-core ``DistributedOptimizer.sharded_state_dict``
      "allows checkpoint resharding only in DP dimension"; ``checkpoint.dist_ckpt_optim_fully_reshardable=true``
      saves a format that reshards.
    """
    from bridge_ext.errors import UserError

    ckpt, opt, m = cfg.checkpoint, cfg.optimizer, cfg.model
    saved_opt, saved_ckpt, saved_model = (saved.get(k) or {} for k in ("optimizer", "checkpoint", "model"))
    if not (ckpt.load_optim and saved_ckpt.get("save_optim", True) and saved_opt.get("use_distributed_optimizer")):
        return
    if saved_ckpt.get("ckpt_format", "torch_dist") != "torch_dist":
        return
    sizes = (saved_model.get("tensor_model_parallel_size") or 1, saved_model.get("pipeline_model_parallel_size") or 1)
    now = (m.tensor_model_parallel_size or 1, m.pipeline_model_parallel_size or 1)
    fix = "resume with checkpoint.load_optim=false (the weights, a fresh optimizer) or"
    if not opt.use_distributed_optimizer:
        raise UserError(f"{where} holds the distributed optimizer's state (saved with "
                        "optimizer.use_distributed_optimizer=true), which loads only into the distributed optimizer; "
                        "this run has none (CPU mode turns it off on one process): "
                        f"{fix} with the distributed optimizer on several processes")
    if sizes != now and not saved_ckpt.get("dist_ckpt_optim_fully_reshardable"):
        raise UserError(f"{where} holds the distributed optimizer's state in its data-parallel-only format "
                        f"(checkpoint.dist_ckpt_optim_fully_reshardable=false), which loads only at TP{sizes[0]} "
                        f"PP{sizes[1]}; this run is TP{now[0]} PP{now[1]}: {fix} at TP{sizes[0]} PP{sizes[1]} "
                        "(save with checkpoint.dist_ckpt_optim_fully_reshardable=true to change TP or PP)")


def prepare(cfg: Any, *, world_size: int) -> str | None:
    """Before a resume: a refusal of optimizer state this layout cannot load; RNG state off when its sharding
    changed with the expert-parallel size; the note.

    Megatron Bridge shards ``rng_state`` over (PP, TP, DP) when EP > 1, else over (PP, TP), and ignores it
    itself when TP or PP changed. Reads the ``run_config.yaml`` of the iteration ``checkpoint.load``
    resumes (``ckpt_step`` or the tracker). A change of the data-parallel size alone under EP > 1 is left to
    Megatron Bridge (the run config does not record the world size).
    """
    from bridge_ext.checkpoints import iteration_dir, read_tracker

    ckpt = cfg.checkpoint
    if not ckpt.load or ckpt.finetune:
        return None
    iteration = ckpt.ckpt_step if ckpt.ckpt_step is not None else read_tracker(ckpt.load)[0]
    run_config = iteration_dir(ckpt.load, iteration) / "run_config.yaml" if iteration is not None else None
    if run_config is None or not Path(run_config).is_file():
        return None
    saved_run = read_yaml(Path(run_config)) or {}
    _refuse_distributed_optimizer_state(cfg, saved_run, f"{ckpt.load} iteration {iteration}")
    if not ckpt.load_rng:
        return None
    saved = saved_run.get("model") or {}
    m = cfg.model
    before, now = _expert_parallel(saved), m.expert_model_parallel_size or 1
    same_tp_pp = (saved.get("tensor_model_parallel_size"), saved.get("pipeline_model_parallel_size")) == (
        m.tensor_model_parallel_size, m.pipeline_model_parallel_size)
    if before == now or not same_tp_pp:
        return None  # the same sharding, or a TP/PP change Megatron Bridge already handles (it says so)
    ckpt.load_rng = False
    if not is_rank_zero():
        return None
    return (f"resuming {ckpt.load} (saved with EP{before}) with EP{now}: the RNG state is sharded by the "
            "expert-parallel layout and is not loaded (new per-rank RNG streams, as for a TP/PP change)")
