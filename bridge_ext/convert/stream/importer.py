"""Streaming import: Hugging Face safetensors -> a Megatron torch_dist checkpoint, parameter by parameter, without
building the model (``nemo llm import``'s default path).

Per Megatron parameter, in the skeleton's order (:mod:`~bridge_ext.convert.stream.skeleton`): its HF tensors are
read by byte range (:mod:`~bridge_ext.convert.stream.hf_io`), passed through Megatron Bridge's own load hook
(``maybe_modify_loaded_hf_weight``: fp8 dequantization in 0.6's DeepSeek-V3 bridge) and, for fp8 releases, our
dequantization (:func:`bridge_ext.hf.fp8.fp8_dequantizing`), converted by the parameter's mapping
(``mapping.hf_to_megatron``: QKV interleaving, gate|up, MLA, experts), cast to the parameter's dtype (what
``param.copy_`` does on the model-building path) and written as the chunks megatron-core stores it in
(:mod:`~bridge_ext.convert.stream.torch_dist`). Memory: one parameter per writer thread, plus its HF inputs.
The rest of the checkpoint (common state, ``metadata.json``, ``run_config.yaml``, ``train_state.pt``, tracker,
tokenizer assets) is written by Megatron Bridge's ``save_checkpoint`` and megatron-core, as on the
model-building path (``save_megatron_model``, ``training/model_load_save.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bridge_ext.convert.stream.hf_io import HFByteReader, LazyHFState
from bridge_ext.convert.stream.skeleton import NeedsModel, Skeleton, build_skeleton, cpu_twin
from bridge_ext.convert.stream.torch_dist import make_strategy
from bridge_ext.errors import UserError
from bridge_ext.hf.untrusted import check_loaded_finite

__all__ = ["DEFAULT_THREADS", "import_streaming", "save_skeleton_checkpoint"]

# Writer threads: conversion (torch copies) and I/O release the GIL; two keep a 2-core machine's disk busy.
DEFAULT_THREADS = 2


def _hf_names(hf_param: str | dict[str, str]) -> list[str]:
    return [hf_param] if isinstance(hf_param, str) else list(hf_param.values())


def save_skeleton_checkpoint(model: list[Any], path: Path, strategy: Any, *, tokenizer: Path | None) -> None:
    """Megatron Bridge's ``save_megatron_model`` (``training/model_load_save.py``, 0.3-0.6: the same
    ``ConfigContainer`` for a weights-only checkpoint, then ``save_checkpoint`` and the tokenizer assets), with
    ``strategy`` as the torch_dist save strategy (``checkpointing_context["save_strategy"]``, which
    ``save_checkpoint`` uses when given) and the meta ``model`` giving the sharded state dict."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.utils import get_model_config
    from megatron.bridge.training.checkpointing import get_checkpoint_name, save_checkpoint, save_tokenizer_assets
    from megatron.bridge.training.config import CheckpointConfig, ConfigContainer, LoggerConfig
    from megatron.bridge.training.state import GlobalState
    from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer

    tokenizer_config = None
    if tokenizer is not None:
        from megatron.bridge.training.tokenizers.config import TokenizerConfig

        tokenizer_config = TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tokenizer),
                                           hf_tokenizer_kwargs={})  # fmt: skip
    state = GlobalState()
    state.cfg = ConfigContainer(
        model=get_model_config(model[0]), train=None, optimizer=OptimizerConfig(use_distributed_optimizer=False),
        ddp=None, scheduler=None, dataset=None, logger=LoggerConfig(), tokenizer=tokenizer_config,
        checkpoint=CheckpointConfig(async_save=False, save=str(path), save_optim=False, save_rng=False,
                                    ckpt_format="torch_dist", dist_ckpt_optim_fully_reshardable=True),
        dist=None,
    )  # fmt: skip
    save_checkpoint(state=state, model=model, optimizer=None, opt_param_scheduler=None,
                    num_floating_point_operations_so_far=0, checkpointing_context={"save_strategy": strategy})
    # ModelOpt writes its own copy of the model config when run_config.yaml is not there yet (it is written
    # after: save_sharded_modelopt_state); save_megatron_model's low-memory save, which passes no model, has none.
    iter_dir = Path(get_checkpoint_name(str(path), 0, release=False))
    if (iter_dir / "run_config.yaml").is_file():
        (iter_dir / "modelopt_run_config.yaml").unlink(missing_ok=True)
    if tokenizer_config is not None:
        save_tokenizer_assets(build_tokenizer(tokenizer_config), tokenizer_config,
                              get_checkpoint_name(str(path), 0, release=False))  # fmt: skip
    from bridge_ext.checkpoints.integrity import record_save

    record_save(iter_dir)  # the integrity record of what is there now, tokenizer included


class _Converter:
    """``produce(owner)``: one Megatron parameter's full value from the HF checkpoint; counts what it read."""

    def __init__(self, skeleton: Skeleton, source: Any, reader: HFByteReader, *, progress: Any):
        from bridge_ext.hf.fp8 import fp8_dequantizing

        self.skeleton = skeleton
        self.source = source
        self.state = LazyHFState(reader)
        self.reader = reader
        load = skeleton.model_bridge.maybe_modify_loaded_hf_weight
        self.load = fp8_dequantizing(load, source) if source.fp8 else load
        self.progress = progress
        self.used: set[str] = set()  # stored tensors read (fused expert tensors count once), fp8 scales included
        self.bytes = 0
        self._lock = threading.Lock()  # done() runs on the writer threads
        self._claims: dict[tuple[int, str], list[str]] = {}
        seen: set[str] = set()
        for owner, task in skeleton.tasks.items():  # the stored tensors each parameter reads first
            names = list(dict.fromkeys(source.stored_name(n) for n in _hf_names(task.mapping.hf_param)))
            names += [c for n in names for c in source.companions(n)]  # fp8 / int4 scales
            self._claims[owner] = [n for n in names if n not in seen]
            seen.update(names)
        self.total = len(seen & set(source.tensors))
        self.total_bytes = sum(source.tensors[n].nbytes for n in seen & set(source.tensors))

    def produce(self, owner: tuple[int, str]) -> Any:
        task = self.skeleton.tasks[owner]
        param = self.skeleton.params[owner]
        hf_weights = self.load(task.mapping.hf_param, self.state)
        check_loaded_finite(hf_weights, task.mapping.hf_param, source=self.source)
        converted = task.mapping.hf_to_megatron(hf_weights, cpu_twin(task.megatron_module))
        del hf_weights
        if converted is None or converted.device.type == "meta":
            raise NeedsModel(f"the mapping of {owner[1]} ({type(task.mapping).__name__}) returned no values")
        if tuple(converted.shape) != tuple(param.shape):
            names = _hf_names(task.mapping.hf_param)
            raise UserError(f"{self.source.path}: {names[0]} converts to shape {list(converted.shape)}, the model "
                            f"built from config.json needs {list(param.shape)} for {owner[1]}")  # fmt: skip
        return converted.to(param.dtype)

    def done(self, owner: tuple[int, str], _: int) -> None:
        claimed = [n for n in self._claims.get(owner, []) if n in self.source.tensors]
        nbytes = sum(self.source.tensors[n].nbytes for n in claimed)
        with self._lock:
            self.used.update(claimed)
            self.bytes += nbytes
            if self.progress is not None:
                self.progress.advance(nbytes, tensors=len(claimed))


def import_streaming(
    source: Any,
    target: Path,
    *,
    summary: Any,
    cpu: bool,
    verify: bool = False,
    tolerance: float,
    threads: int = DEFAULT_THREADS,
    progress: bool = True,
    console: Callable[[str], None] | None = print,
) -> Any:
    """The validated HF checkpoint ``source`` -> a torch_dist checkpoint at ``target`` (staged, renamed into place
    when complete and verified) without building the model; fills and returns ``summary``
    (``ConversionSummary``). ``cpu``: what ``prepare_runtime`` returned (for ``--verify``'s model).

    Raises :class:`~bridge_ext.convert.stream.skeleton.NeedsModel` (nothing written) when a parameter needs the
    model-building path. Under torchrun each process converts every world-th parameter into its own files; the
    checkpoint is the same.
    """
    import torch
    from megatron.bridge.models.hf_pretrained.causal_lm import PreTrainedCausalLM

    from bridge_ext.hf.directory import hf_tokenizer_loadable, write_hf_source
    from bridge_ext.hf.read import per_expert_state
    from bridge_ext.convert.model import ConfigSource
    from bridge_ext.convert.parallel import is_rank0, process_group, union_over_ranks
    from bridge_ext.convert.report import TensorProgress, record_source_use
    from bridge_ext.convert.staging import staged_output
    from bridge_ext.convert.verify import verify_import

    hf = source.path
    dtype = getattr(torch, source.dtype)
    reader = HFByteReader(source)
    try:
        with process_group(True), staged_output(target) as staging:
            pretrained = PreTrainedCausalLM(model_name_or_path=str(hf.absolute()), torch_dtype=dtype)
            pretrained.config = source.config  # built without remote code; AutoConfig would refuse kimi_k2
            names = ConfigSource(source.config, path=str(hf.absolute()), state=per_expert_state(source))
            skeleton = build_skeleton(source.config, model_type=source.raw_config.get("model_type"), dtype=dtype,
                                      hf=names, pretrained=pretrained)  # fmt: skip
            converter = _Converter(skeleton, source, reader, progress=None)
            with TensorProgress("import", total=converter.total, enabled=progress and is_rank0(),
                                total_bytes=converter.total_bytes) as bar:
                converter.progress = bar
                strategy = make_strategy(skeleton=skeleton, produce=converter.produce, threads=threads,
                                         done=converter.done)  # fmt: skip
                tokenizer = hf.absolute() if hf_tokenizer_loadable(hf) else None
                save_skeleton_checkpoint(skeleton.model, staging, strategy, tokenizer=tokenizer)
            record_source_use(summary, source, union_over_ranks(converter.used))
            if is_rank0():
                write_hf_source(hf, staging, source)
            if verify:
                summary.max_logit_diff = verify_import(staging, hf, source=source, cpu=cpu, tolerance=tolerance,
                                                       target=target, console=console)  # fmt: skip
    finally:
        reader.close()
    return summary
