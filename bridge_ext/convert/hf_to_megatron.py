"""Import: a Hugging Face directory -> a Megatron torch_dist checkpoint (``nemo llm import``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bridge_ext.convert.model import ConfigSource, bridge_for, build_model, model_param_names, prepare_runtime
from bridge_ext.convert.parallel import check_layout, is_rank0, process_group, union_over_ranks
from bridge_ext.convert.report import ConversionSummary, TensorProgress, human_bytes, record_source_use, say_on_rank0
from bridge_ext.convert.staging import check_target, staged_output
from bridge_ext.convert.stream import DEFAULT_THREADS, NeedsModel, import_streaming
from bridge_ext.convert.verify import VERIFY_TOLERANCE, verify_import
from bridge_ext.errors import UserError
from bridge_ext.hf.directory import (
    HFSource,
    architecture_of,
    hf_tokenizer_loadable,
    inspect_hf_dir,
    write_hf_source,
)
from bridge_ext.hf.fp8 import fp8_dequantizing
from bridge_ext.hf.read import per_expert_state
from bridge_ext.hf.untrusted import check_loaded_finite, check_model_fits
from bridge_ext.runtime import launcher_world_size

__all__ = ['import_hf']


def _load_hf_into_megatron(
    bridge: Any, pretrained: Any, model: list[Any], source: HFSource, *, progress: bool
) -> tuple[int, int]:
    """Load every Megatron parameter from the HF tensors (``model_bridge.py:697-803``, with accounting).

    ``pretrained`` gives the tensors (``.state``) under the names of Megatron Bridge's mappings; accounting is in
    the tensors on disk (a fused checkpoint's per-expert names count as the fused tensor that holds them).
    Returns the HF tensors read (fp8 scales included) and their bytes.
    """
    import torch

    model_bridge = bridge._model_bridge
    tasks = [t for t in model_bridge.build_conversion_tasks(pretrained, model) if t is not None]
    local = [t for t in tasks if t.megatron_module is not None]
    loaded = {(t.vp_stage, t.param_name) for t in local}
    missing = [vp_name for vp_name in model_param_names(model) if vp_name not in loaded]
    if missing:
        raise RuntimeError(
            f"no conversion for Megatron parameter {missing[0][1]} ({len(missing)} in all); "
            "the Megatron Bridge mapping for this architecture is incomplete"
        )
    state = pretrained.state
    load = model_bridge.maybe_modify_loaded_hf_weight
    if source.fp8:
        load = fp8_dequantizing(load, source)
    seen: set[str] = set()
    nbytes = 0
    total = len({source.stored_name(n) for t in local for n in _hf_names(t.mapping.hf_param)})
    with TensorProgress("import", total=total, enabled=progress and is_rank0()) as bar:
        for task in local:
            hf_weights = load(task.mapping.hf_param, state)
            check_loaded_finite(hf_weights, task.mapping.hf_param, source=source)
            converted = task.mapping.hf_to_megatron(hf_weights, task.megatron_module)
            names = list(dict.fromkeys(source.stored_name(n) for n in _hf_names(task.mapping.hf_param)))
            fresh = [n for n in names if n not in seen]
            names += [c for n in names for c in source.companions(n)]  # fp8 block scales, int4 scales
            task_bytes = sum(source.tensors[n].nbytes for n in names if n in source.tensors and n not in seen)
            seen.update(names)
            nbytes += task_bytes
            if converted is not None:
                if converted.shape != task.param_weight.shape:
                    raise UserError(
                        f"{source.path}: {names[0]} converts to shape {list(converted.shape)}, the model built from "
                        f"config.json needs {list(task.param_weight.shape)} for {task.param_name}"
                    )
                with torch.no_grad():
                    task.param_weight.data.copy_(converted)
            del hf_weights, converted
            bar.advance(task_bytes, tensors=len(fresh))
    model_bridge._broadcast_shared_embeddings(model)
    return seen & set(source.tensors), nbytes


def _hf_names(hf_param: str | dict[str, str]) -> list[str]:
    return [hf_param] if isinstance(hf_param, str) else list(hf_param.values())


def import_hf(
    hf: str | Path,
    out: str | Path,
    *,
    verify: bool = False,
    overwrite: bool = False,
    tolerance: float = VERIFY_TOLERANCE,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    progress: bool = True,
    console: Callable[[str], None] | None = print,
    stream: bool = True,
    threads: int = DEFAULT_THREADS,
) -> ConversionSummary:
    """Convert the HF checkpoint ``hf`` into a Megatron (torch_dist) checkpoint at ``out``.

    ``out`` receives ``iter_0000000/`` + ``latest_checkpointed_iteration.txt`` (what recipes load with
    ``checkpoint.pretrained_checkpoint=out``) and ``hf_source/`` (config.json bytes, tokenizer files).
    ``stream`` (default): tensor by tensor without building the model (:mod:`bridge_ext.convert.stream`, the
    same checkpoint; under torchrun the processes share the parameters); with ``stream=False``, a ``tp/pp/ep``
    layout, or where a parameter needs the model (``NeedsModel``), through the built model.
    """
    start = time.perf_counter()
    hf, target = Path(hf), Path(out)
    check_target(target, overwrite=overwrite, inputs=[hf] if hf.exists() else [])
    if verify and (launcher_world_size() or 1) > 1:
        raise UserError("--verify runs in one process; drop it under torchrun and verify with a one-process import")
    source = inspect_hf_dir(hf)
    check_layout(architecture_of(source.config, source.raw_config), tp=tp, pp=pp, ep=ep)
    world = launcher_world_size() or 1
    if verify:
        check_model_fits(parameters=source.parameters, bytes_per_param=4, processes=1, where=hf / "config.json",
                         what="--verify's fp32 model", hint="import without --verify")  # fmt: skip
    summary = ConversionSummary(direction="import", out=target)
    say_on_rank0(console, f"importing {source.family.display} from {hf} "
                          f"({len(source.tensors)} tensors, {human_bytes(source.total_bytes)}, {source.dtype})")  # fmt: skip

    cpu = prepare_runtime()
    if stream and tp == pp == ep == 1:  # a layout asks for the model-building (distributed) conversion
        try:
            import_streaming(source, target, summary=summary, cpu=cpu, verify=verify, tolerance=tolerance,
                             threads=threads, progress=progress, console=console)  # fmt: skip
            summary.seconds = time.perf_counter() - start
            return summary
        except NeedsModel as exc:
            summary.notes.append(f"converted through the built model: {exc}")
    import torch
    from megatron.bridge.models.hf_pretrained.causal_lm import PreTrainedCausalLM
    from megatron.bridge.training.model_load_save import save_megatron_model

    dtype = getattr(torch, source.dtype)
    check_model_fits(parameters=source.parameters, bytes_per_param=dtype.itemsize, processes=world,
                     where=hf / "config.json", what="the model-building conversion (--no-stream, --tp/--pp/--ep)",
                     hint="stream it (drop --no-stream and --tp/--pp/--ep) or launch more processes with torchrun")
    with process_group(cpu), staged_output(target) as staging:
        pretrained = PreTrainedCausalLM(model_name_or_path=str(hf.absolute()), torch_dtype=dtype)
        pretrained.config = source.config  # built without remote code; AutoConfig would refuse kimi_k2
        bridge = bridge_for(source.config, pretrained, model_type=source.raw_config.get("model_type"))
        model = build_model(bridge, cpu=cpu, dtype=dtype, tp=tp, pp=pp, ep=ep)
        if source.expert_layout == "fused" or source.int4:  # experts by name, one by one; int4 read dequantized
            pretrained = ConfigSource(source.config, path=str(hf.absolute()), state=per_expert_state(source))
        used, _ = _load_hf_into_megatron(bridge, pretrained, model, source, progress=progress)
        # each rank reads the tensors of its own shard (layers, experts)
        record_source_use(summary, source, union_over_ranks(used))
        tokenizer = hf.absolute() if hf_tokenizer_loadable(hf) else None
        say_on_rank0(console, "writing torch_dist checkpoint")
        save_megatron_model(model, str(staging), hf_tokenizer_path=tokenizer, low_memory_save=True)
        del model
        from bridge_ext.checkpoints import iteration_dir
        from bridge_ext.checkpoints.integrity import record_save

        record_save(iteration_dir(staging, 0))  # save_megatron_model writes iteration 0
        if is_rank0():
            write_hf_source(hf, staging, source)
        if verify:
            summary.max_logit_diff = verify_import(staging, hf, source=source, cpu=cpu, tolerance=tolerance,
                                                   target=target, console=console)  # fmt: skip
    summary.seconds = time.perf_counter() - start
    return summary
