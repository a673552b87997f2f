"""Training-loop patches: Megatron Bridge's start-up, scheduler and config validation.

* ``prebuilt-dataset-helpers`` (scope ``stack``): megatron-bridge 0.3 ``training/initialize.py`` calls
  megatron-core's ``datasets/utils.py`` ``compile_helpers()``, which runs ``make`` in a directory where the
  PyPI wheel ships the prebuilt ``helpers_cpp`` extension but no Makefile -> ``sys.exit(1)``. Applies where the
  Makefile is absent (every PyPI install); skipped where it exists (a source checkout, the container's build).
* ``scheduler-warmup-cap`` (``stack``): megatron-bridge 0.3.1 ``training/config.py`` caps ``lr_warmup_steps``
  below ``lr_decay_steps`` with a warning (short runs of recipes tuned for long ones); 0.3.0 does not, and
  megatron-core's scheduler asserts at launch. Applies on 0.3.0 (the container's); skipped on 0.3.1.
* ``validate-without-gpu`` (``dryrun``, only for the duration of a dry run's ``validate()``): the flex
  dispatcher check reads ``torch.cuda.get_device_properties(0)``; skipped when no GPU is visible.
* ``yaml-signal-target`` (``config``, applied before user YAML is instantiated): megatron-bridge 0.4
  ``utils/instantiate_utils.py`` instantiates only ``_target_`` values under an allow-list of module
  prefixes, which lacks ``signal.``; ``train.exit_signal`` (a ``signal.Signals``) is written as
  ``_target_: signal.Signals`` by its own YAML representers, so its own ``ConfigContainer.from_yaml`` and a
  ``--yaml`` that changes it could not read it back. ``signal.Signals`` is registered through upstream's
  ``register_allowed_target_prefix``, where the installed allow-list refuses it (0.3 has none).
* ``training-log-attention-logit`` (``stack``): megatron-bridge 0.5 ``training/train.py`` ``train()`` calls
  ``training_log(..., model, log_max_attention_logit, ...)`` positionally, but 0.5's ``utils/train_utils.py``
  ``training_log`` takes ``pg_collection`` after ``model``: a measured max logit (MuonClip, QK-clip logging)
  becomes the process-group collection (``'float' object has no attribute 'mp'``). 0.6 passes both by keyword;
  the ``training_log`` that ``train.py`` calls takes that argument as ``log_max_attention_logit``, as upstream's
  fix does. Applies where a ``training_log`` call in ``train.py`` passes ``log_max_attention_logit`` in another
  parameter's position.
* ``sft-batches-in-dataset-order`` (``stack``): megatron-bridge 0.6 ``data/samplers.py``
  ``MegatronPretrainingBatchSampler`` (the fine-tuning loaders' ``dataloader_type="batch"``) reshuffles every
  epoch by default (``shuffle=True``, ``torch.randperm`` of ``dataset.seed`` + epoch), and
  ``build_pretraining_data_loader`` passes no ``shuffle``: the held-out records were read in another order
  every eval pass and for every seed (the same records, other batches: eval losses of one model that differ
  in the last bits), the training records in another order than the one ``bridge_ext.finetune`` writes.
  0.3-0.5 read both in file order, as ``docs/finetune.md`` (Data order) relies on; the default is made
  ``shuffle=False`` (an explicit ``shuffle=`` still wins; 0.6's epoch-aware resume offsets are kept). Applies
  where the sampler takes ``shuffle`` with default True and the loader's call passes none.
* ``sft-epochs-after-resume-from-the-start`` (``stack``): megatron-bridge 0.3-0.5 ``data/samplers.py``
  ``MegatronPretrainingBatchSampler.__iter__`` starts every pass at ``consumed_samples % total_samples`` and
  never advances it; ``data/loaders.py`` re-iterates it every epoch (``cyclic_iter``). A fine-tuning run
  resumed mid-epoch (or after a ``drop_last`` remainder) skipped the head of every later epoch and read other
  batches than the uninterrupted run (training and held-out loaders alike). Each pass now starts where the
  uninterrupted run is in its epoch (epochs of whole global batches, as 0.6's epoch-aware sampler counts them),
  the next pass at the first record. Applies where ``__iter__`` still starts at ``consumed_samples %
  total_samples``; 0.6 fixed it upstream.
* ``manual-gc-restored`` (``stack``): megatron-bridge ``training/train.py`` ``train()`` turns the garbage
  collector off under ``train.manual_gc`` (Kimi K2's and Moonlight's presets) and never back on: a process that
  goes on after ``pretrain()`` (the Python API, a notebook, in-process tests) keeps every later reference cycle,
  each run's gloo process groups with their threads and sockets among them. ``pretrain``'s ``train`` restores
  the collector's state when it returns. Applies on every stack so far (0.3-0.6).
* ``ddp-hook-cycle`` (``stack``): megatron-core ``distributed/distributed_data_parallel.py``: the backward hook
  ``DistributedDataParallel`` puts on each parameter's gradient accumulator (a C++ autograd node) closes over
  the wrapper, which keeps the accumulators (``grad_accs``): a cycle Python's collector cannot see, so no
  wrapped model is ever freed (each run in one process keeps its model, buffers and gloo process groups). The
  hook holds the wrapper by weak reference and calls upstream's. Applies where the hook closes over ``self``
  (megatron-core 0.16-0.19).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from pathlib import Path

from bridge_ext.stack import UpstreamDrift, call_keywords, module_source, package_of
from bridge_ext.upstream_patch import Patch

__all__ = ["PATCHES"]

# --- megatron-bridge 0.3 training/initialize.py -> megatron-core datasets/utils.py compile_helpers() -------
_INITIALIZE = "megatron.bridge.training.initialize"


def _compile_helpers_needed() -> bool:
    if "compile_helpers" not in {node.func.id for node in ast.walk(ast.parse(module_source(_INITIALIZE)))
                                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}:
        return False  # upstream no longer builds the helpers at start-up
    datasets = importlib.import_module("megatron.core.datasets")
    if (Path(datasets.__file__).parent / "Makefile").exists():
        return False  # a source tree: `make` works (given a compiler)
    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
        raise UpstreamDrift(f"{package_of('megatron.core')}: megatron.core.datasets ships neither a Makefile "
                            "nor the prebuilt helpers_cpp; reinstall megatron-core from its wheel")
    return True


def _use_prebuilt_helpers() -> None:
    importlib.import_module("megatron.core.datasets.helpers_cpp")


# --- megatron-bridge 0.3.0 training/config.py ConfigContainer._calculate_scheduler_steps -------------------
# 0.3.1 caps lr_warmup_steps at lr_decay_steps - 1 with a warning (a short run of a recipe tuned for a long
# one); 0.3.0 leaves it, and megatron-core's OptimizerParamScheduler then fails with a bare AssertionError
# (`assert self.lr_warmup_steps < self.lr_decay_steps`) at launch. Same behaviour on both: cap and warn.
_MB_CONFIG = "megatron.bridge.training.config"


def _warmup_cap_needed() -> bool:
    from megatron.bridge.training.config import ConfigContainer

    if not hasattr(ConfigContainer, "_calculate_scheduler_steps"):
        raise UpstreamDrift(f"{package_of(_MB_CONFIG)}: ConfigContainer has no _calculate_scheduler_steps; "
                            "bridge_ext.patches' warm-up cap needs updating")
    return "lr_warmup_steps >= self.scheduler.lr_decay_steps" not in inspect.getsource(
        ConfigContainer._calculate_scheduler_steps)


def _warmup_cap(original: Callable) -> Callable:
    from megatron.bridge.utils.common_utils import warn_rank_0

    def _calculate_scheduler_steps(self) -> None:
        original(self)
        scheduler = self.scheduler
        if scheduler.lr_decay_steps > 0 and scheduler.lr_warmup_steps >= scheduler.lr_decay_steps:
            capped = scheduler.lr_decay_steps - 1
            warn_rank_0(f"lr_warmup_steps ({scheduler.lr_warmup_steps}) >= lr_decay_steps ({scheduler.lr_decay_steps}); "
                        f"capping lr_warmup_steps to {capped}. Reduce lr_warmup_iters (or lr_warmup_samples) for "
                        "short training runs.")
            scheduler.lr_warmup_steps = capped

    return _calculate_scheduler_steps


def _no_gpu() -> bool:
    import torch

    return not torch.cuda.is_available()


# --- megatron-bridge 0.4 utils/instantiate_utils.py: the _target_ allow-list ---------------------------------
_INSTANTIATE = "megatron.bridge.utils.instantiate_utils"
_SIGNALS = "signal.Signals"  # what safe_yaml_representers' enum representer writes for train.exit_signal
_registered: set[str] = set()  # what we added to the allow-list (upstream's answer, not ours, decides)


def _signals_refused() -> bool:
    """Whether the installed instantiate refuses ``signal.Signals`` (asked of its own prefix check)."""
    if _SIGNALS in _registered:
        return True
    check = getattr(importlib.import_module(_INSTANTIATE), "_validate_target_prefix", None)
    if check is None:
        return False  # no allow-list (megatron-bridge 0.3)
    try:
        check(target=_SIGNALS, full_key="")
    except Exception:  # InstantiationException
        return True
    return False


def _allow_signals() -> None:
    importlib.import_module(_INSTANTIATE).register_allowed_target_prefix(_SIGNALS)
    _registered.add(_SIGNALS)


# --- megatron-bridge 0.5 training/train.py train() -> utils/train_utils.py training_log ------------------------
_TRAIN = "megatron.bridge.training.train"
_LOGIT = "log_max_attention_logit"


def _logit_slot() -> int | None:
    """The position at which ``train.py`` passes ``log_max_attention_logit`` to ``training_log`` where that
    position is another parameter's (None where every call passes it in its own place or by keyword)."""
    from megatron.bridge.training import train

    names = list(inspect.signature(train.training_log).parameters)
    slots = {index for node in ast.walk(ast.parse(module_source(_TRAIN))) if isinstance(node, ast.Call)
             and getattr(node.func, "id", None) == "training_log"
             for index, arg in enumerate(node.args) if isinstance(arg, ast.Name) and arg.id == _LOGIT}
    wrong = {index for index in slots if index >= len(names) or names[index] != _LOGIT}
    if len(wrong) > 1 or (wrong and _LOGIT not in names):
        raise UpstreamDrift(f"{package_of(_TRAIN)}: train.py passes {_LOGIT} to training_log at positions "
                            f"{sorted(wrong)}; bridge_ext.patches' training-log-attention-logit needs updating")
    return next(iter(wrong), None)


def _logit_misplaced() -> bool:
    return _logit_slot() is not None


def _logit_by_name(original: Callable) -> Callable:
    slot = _logit_slot()

    def training_log(*args, **kwargs):
        if len(args) == slot + 1 and _LOGIT not in kwargs:  # train.py's call: the last positional is the logit
            *args, kwargs[_LOGIT] = args
        return original(*args, **kwargs)

    training_log.__wrapped__ = original
    return training_log


# --- megatron-bridge training/train.py train(): train.manual_gc turns the garbage collector off for good -----
# ``gc.disable()`` when ``train.manual_gc`` is set (Kimi K2's and Moonlight's presets, as upstream's DeepSeek
# recipes), and no ``gc.enable()`` on any way out: after ``pretrain()`` returns, the process never collects a
# reference cycle again (measured: ``gc.isenabled()`` False after a Kimi K2 proxy run). A process that goes on
# (the Python API, a notebook, tests) keeps every later cycle: a model and its optimizer are full of them.
_PRETRAIN = "megatron.bridge.training.pretrain"


def _gc_left_off() -> bool:
    source = inspect.getsource(importlib.import_module(_TRAIN).train)
    if "gc.disable()" not in source:
        return False  # upstream no longer turns the collector off
    return "gc.enable()" not in source


def _gc_restored(original: Callable) -> Callable:
    import gc

    def train(*args, **kwargs):
        was_on = gc.isenabled()
        try:
            return original(*args, **kwargs)
        finally:
            if was_on:
                gc.enable()

    train.__wrapped__ = original
    return train


# --- megatron-core distributed/distributed_data_parallel.py: gradient hooks that keep the model for good -----
# DistributedDataParallel.__init__ registers, on each parameter's gradient accumulator (an autograd node, C++),
# a hook that closes over the wrapper (``self``) and keeps the accumulators in ``self.grad_accs``: a reference
# cycle through C++ that Python's collector cannot see, so no model wrapped in it is ever freed. A process
# that goes on after ``pretrain()`` keeps each run's model, gradient buffers and process groups (their gloo
# threads and sockets; measured: +49 threads, +65 descriptors and one more live GPTModel per Qwen3-MoE proxy
# run, a run from 2 s to 7 s once ~1,000 threads piled up; on a GPU, the first run's memory).
_DDP = "megatron.core.distributed.distributed_data_parallel"


def _hook_closes_over_ddp() -> bool:
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel

    make = inspect.unwrap(DistributedDataParallel._make_backward_post_hook)
    if list(inspect.signature(make).parameters) != ["self", "param"]:
        raise UpstreamDrift(f"{package_of(_DDP)}: DistributedDataParallel._make_backward_post_hook takes "
                            f"{list(inspect.signature(make).parameters)}; bridge_ext.patches' ddp-hook-cycle needs "
                            "updating")
    return "self" in make.__code__.co_cellvars  # the hook it returns holds the wrapper


def _hook_holding_ddp_weakly(original: Callable) -> Callable:
    import weakref

    def _make_backward_post_hook(self, param):
        ddp = weakref.ref(self)

        def hook(*unused):
            live = ddp()
            if live is not None:  # upstream's hook, made for this call (a closure: no work beyond its body)
                return original(live, param)(*unused)

        return hook

    _make_backward_post_hook.__wrapped__ = original
    return _make_backward_post_hook


_SAMPLERS = "megatron.bridge.data.samplers"


def _batch_sampler_reshuffles() -> bool:
    """Whether the installed fine-tuning batch sampler shuffles unless told not to, and the loader never tells it."""
    samplers = importlib.import_module(_SAMPLERS)
    shuffle = inspect.signature(samplers.MegatronPretrainingBatchSampler.__init__).parameters.get("shuffle")
    if shuffle is None:  # 0.3-0.5: file order, no such parameter
        return False
    keywords = call_keywords(_SAMPLERS, "MegatronPretrainingBatchSampler", inside="build_pretraining_data_loader")
    if not keywords:
        raise UpstreamDrift(f"{package_of(_SAMPLERS)}: build_pretraining_data_loader no longer builds "
                            "MegatronPretrainingBatchSampler with keywords; bridge_ext's "
                            "'sft-batches-in-dataset-order' needs updating for this release")
    return shuffle.default is True and "shuffle" not in keywords


def _in_dataset_order(original: Callable) -> Callable:
    def __init__(self, *args, shuffle: bool = False, **kwargs):
        original(self, *args, shuffle=shuffle, **kwargs)

    __init__.__wrapped__ = original
    return __init__


_RESUME_OFFSET_EVERY_PASS = "for idx in range(self.consumed_samples % self.total_samples, self.total_samples):"


def _batch_sampler_restarts_at_resume_offset() -> bool:
    """Whether the fine-tuning batch sampler starts every pass at the resume offset (0.3-0.5's ``__iter__``)."""
    return _RESUME_OFFSET_EVERY_PASS in module_source(_SAMPLERS)


def _epochs_from_the_start(original: Callable) -> Callable:
    def __iter__(self):
        size = self._global_batch_size
        # an epoch as the training loop counts it: whole global batches (the remainder dropped, or padded)
        whole = self.total_samples // size if self.drop_last else -(-self.total_samples // size)
        if whole:
            self.consumed_samples %= whole * size  # where the uninterrupted run is in its epoch
        yield from original(self)
        self.consumed_samples = 0  # the next pass (cyclic_iter's next epoch) starts at the first record

    __iter__.__wrapped__ = original
    return __iter__


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="prebuilt-dataset-helpers", area="training", scope="stack",
        module=_INITIALIZE, attr="compile_helpers",
        upstream="megatron/bridge/training/initialize.py compile_helpers() -> megatron/core/datasets/utils.py",
        why="the PyPI wheel has no Makefile for compile_helpers(); its prebuilt helpers_cpp works",
        when="initialize.py calls compile_helpers() and megatron.core.datasets has no Makefile",
        needed=_compile_helpers_needed,
        make=lambda old: _use_prebuilt_helpers,
    ),
    Patch(
        name="scheduler-warmup-cap", area="training", scope="stack",
        module=_MB_CONFIG, attr="ConfigContainer._calculate_scheduler_steps",
        upstream="megatron/bridge/training/config.py ConfigContainer._calculate_scheduler_steps",
        why="0.3.0 leaves lr_warmup_steps >= lr_decay_steps for megatron-core's scheduler to assert on; "
            "0.3.1 caps it with a warning",
        when="_calculate_scheduler_steps does not cap lr_warmup_steps itself",
        needed=_warmup_cap_needed,
        make=_warmup_cap,
    ),
    Patch(
        name="validate-without-gpu", area="training", scope="dryrun",
        module=_MB_CONFIG, attr="validate_flex_dispatcher_backend",
        upstream="megatron/bridge/training/config.py ConfigContainer.validate -> validate_flex_dispatcher_backend",
        why="reads torch.cuda.get_device_properties(0); a dry run of a GPU recipe validates on a machine "
            "without one (everything else validate() checks still runs)",
        when="no GPU visible, during a dry run's validate() only",
        needed=_no_gpu,
        snippets=("validate_flex_dispatcher_backend(self.model)",),
        elsewhere=(("megatron.bridge.training.flex_dispatcher_backend", ("torch.cuda.get_device_properties(0)",)),),
        make=lambda old: (lambda model_config: None),
    ),
    Patch(
        name="yaml-signal-target", area="training", scope="config",
        module=_INSTANTIATE, attr="register_allowed_target_prefix",
        upstream="megatron/bridge/utils/instantiate_utils.py _validate_target_prefix (_ALLOWED_TARGET_PREFIXES), "
                 "called by instantiate",
        why="train.exit_signal is written as `_target_: signal.Signals` (utils/yaml_utils.py's enum representer) "
            "and the allow-list refuses it: a --yaml that sets it cannot be read back; signal.Signals is added "
            "through upstream's register_allowed_target_prefix",
        when="the installed instantiate's allow-list refuses signal.Signals",
        needed=_signals_refused,
        snippets=("_ALLOWED_TARGET_PREFIXES.add(prefix)", "_validate_target_prefix(target=target, full_key=full_key)"),
        install=_allow_signals,
    ),
    Patch(
        name="training-log-attention-logit", area="training", scope="stack",
        module=_TRAIN, attr="training_log",
        upstream="megatron/bridge/training/train.py train() -> utils/train_utils.py training_log(..., model, "
                 "log_max_attention_logit) positionally",
        why="the max attention logit lands in training_log's pg_collection ('float' object has no attribute "
            "'mp' once QK-clip measures logits); taken as log_max_attention_logit, as megatron-bridge 0.6's "
            "keyword call does",
        when="a training_log call in train.py passes log_max_attention_logit in another parameter's position",
        needed=_logit_misplaced,
        elsewhere=(("megatron.bridge.training.utils.train_utils",
                    ("pg_collection = pg_collection or get_pg_collection(model)",)),),
        make=_logit_by_name,
    ),
    Patch(
        name="sft-batches-in-dataset-order", area="training", scope="stack",
        module=_SAMPLERS, attr="MegatronPretrainingBatchSampler.__init__",
        upstream="megatron/bridge/data/samplers.py MegatronPretrainingBatchSampler (shuffle=True), built by "
                 "build_pretraining_data_loader for dataloader_type='batch' (fine-tuning)",
        why="the held-out records were read in another order every eval pass and for every seed (other batches: "
            "one model's eval losses differ in the last bits), the training records not in the order "
            "bridge_ext.finetune writes; read in dataset order as megatron-bridge 0.3-0.5 do (an explicit "
            "shuffle= still wins)",
        when="the fine-tuning batch sampler reshuffles every epoch by default and the loader passes no shuffle=",
        needed=_batch_sampler_reshuffles,
        snippets=("self.shuffle = shuffle", "if self.shuffle:"),
        make=_in_dataset_order,
    ),
    Patch(
        name="sft-epochs-after-resume-from-the-start", area="training", scope="stack",
        module=_SAMPLERS, attr="MegatronPretrainingBatchSampler.__iter__",
        upstream="megatron/bridge/data/samplers.py MegatronPretrainingBatchSampler.__iter__, re-iterated by "
                 "data/loaders.py cyclic_iter (dataloader_type='batch', fine-tuning)",
        why="every pass starts at consumed_samples % total_samples: a fine-tuning run resumed mid-epoch skips the "
            "head of every later epoch and reads other batches than the uninterrupted run; each pass starts "
            "where the uninterrupted run is in its epoch of whole global batches, the next at the first record "
            "(as megatron-bridge 0.6's epoch-aware sampler does)",
        when="the batch sampler's __iter__ starts every pass at consumed_samples % total_samples",
        needed=_batch_sampler_restarts_at_resume_offset,
        snippets=(_RESUME_OFFSET_EVERY_PASS, "self._global_batch_size = global_batch_size",
                  "pad_samples_to_global_batch_size=not drop_last"),
        make=_epochs_from_the_start,
    ),
    Patch(
        name="manual-gc-restored", area="training", scope="stack",
        module=_PRETRAIN, attr="train",
        upstream="megatron/bridge/training/train.py train(): gc.disable() under train.manual_gc, never re-enabled "
                 "(called by training/pretrain.py)",
        why="after pretrain() the process never collects a reference cycle again (a model and its optimizer are "
            "full of them); the collector is turned back on when train() returns, as it was before",
        when="train() turns the collector off and nowhere back on",
        needed=_gc_left_off,
        snippets=("from megatron.bridge.training.train import",),
        make=_gc_restored,
    ),
    Patch(
        name="ddp-hook-cycle", area="training", scope="stack",
        module=_DDP, attr="DistributedDataParallel._make_backward_post_hook",
        upstream="megatron/core/distributed/distributed_data_parallel.py DistributedDataParallel.__init__: "
                 "grad_acc.register_hook(self._make_backward_post_hook(param)), self.grad_accs",
        why="the hook on each gradient accumulator (a C++ autograd node) holds the wrapper, which holds the "
            "accumulators: a cycle the collector cannot see, so every wrapped model stays alive with its buffers "
            "and process groups (+49 threads and one more live model per MoE proxy run in one process); the hook "
            "holds the wrapper by weak reference and calls upstream's hook",
        when="the backward post-hook closes over the wrapper",
        needed=_hook_closes_over_ddp,
        snippets=("grad_acc.register_hook(self._make_backward_post_hook(param))", "self.grad_accs.append(grad_acc)"),
        make=_hook_holding_ddp_weakly,
    ),
)
