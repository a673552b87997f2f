"""A saved Megatron checkpoint as a model on this machine, and a Hugging Face directory through transformers.

Megatron: the iteration is found and vetted by :func:`bridge_ext.checkpoints.find_iteration`, its model part
checked by :func:`bridge_ext.checkpoints.integrity.verify` (``scope="model"``), then the model is built from the
iteration's own ``run_config.yaml`` (Megatron Bridge's ``load_model_config``: the run's model provider, as
trained), in one process (TP = PP = EP = 1), in CPU mode when no GPU is visible, and its weights are loaded
without the optimizer state (:func:`bridge_ext.convert.megatron_ckpt.load_model_weights`).

The tokenizer is the model's own: ``--tokenizer DIR``, else the checkpoint's saved tokenizer files
(``iter_N/tokenizer``), the run config's ``tokenizer.tokenizer_model`` directory, or ``hf_source/`` of an import;
loaded by :func:`bridge_ext.tokenizers.load_tokenizer` (Kimi K2's tiktoken without remote code). One that produces
ids outside the model's vocabulary is refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bridge_ext.errors import UserError
from bridge_ext.runtime import read_yaml

__all__ = ["HFModel", "KVSession", "MegatronModel", "check_fits", "checkpoint_tokenizer", "hf_model", "megatron_model",
           "open_checkpoint", "quiet_native_output", "read_run_config"]


def read_run_config(iter_dir: Path) -> dict[str, Any]:
    """``iter_N/run_config.yaml`` as a dict (safe_load: no objects); a one-line error when absent or unreadable."""
    import yaml

    file = Path(iter_dir) / "run_config.yaml"
    if not file.is_file():
        raise UserError(f"{iter_dir} has no run_config.yaml: not a Megatron Bridge checkpoint (or a copy cut short)")
    try:
        config = read_yaml(file) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"{file} is not readable YAML ({type(exc).__name__})") from None
    if not isinstance(config.get("model"), dict):
        raise UserError(f"{file} has no model section")
    return config


# What run_config.yaml records of the run's process but cannot (timers, process groups, a built tokenizer) or
# must not (megatron-bridge >= 0.6 refuses to instantiate a layer spec function named in a file) be rebuilt from
# it; the model provider / setup() set their own (the layer spec: configure_for_cpu's local spec on CPU).
RUNTIME_OBJECTS = {
    "dataset": ("tokenizer",),
    "model": ("timers", "finalize_model_grads_func", "grad_scale_func", "no_sync_func", "grad_sync_func",
              "param_sync_func", "generation_config", "transformer_layer_spec"),
    "optimizer": ("timers",),
}


def without_runtime_objects(run_config: dict[str, Any]) -> dict[str, Any]:
    """A copy of a run config without :data:`RUNTIME_OBJECTS`."""
    import copy

    clean = copy.deepcopy(run_config)
    for section, keys in RUNTIME_OBJECTS.items():
        if isinstance(clean.get(section), dict):
            for key in keys:
                clean[section].pop(key, None)
    return clean


def model_provider(run_config: dict[str, Any]) -> Any:
    """The run's model provider, instantiated from its run config's model section (Megatron Bridge's
    ``instantiate``, as its ``load_model_config`` does) without :data:`RUNTIME_OBJECTS`."""
    from megatron.bridge.utils.instantiate_utils import instantiate

    return instantiate(without_runtime_objects(run_config)["model"])


def open_checkpoint(ckpt: str | Path, iteration: int | None = None, *, checksums: bool = True) -> tuple[Path, int]:
    """The iteration to read (vetted) and its number, after the integrity check of its model part."""
    from bridge_ext.checkpoints import find_iteration
    from bridge_ext.checkpoints.integrity import verify

    iter_dir, number = find_iteration(ckpt, iteration)
    verify(iter_dir, scope="model", checksums=checksums)
    return iter_dir, number


def _tokenizer_candidates(ckpt: Path, iter_dir: Path, run_config: dict[str, Any]) -> list[Path]:
    from bridge_ext.hf.directory import HF_SOURCE_DIR

    found = [iter_dir / "tokenizer"]
    tok = run_config.get("tokenizer") or {}
    if isinstance(tok, dict) and tok.get("tokenizer_model"):
        found.append(Path(str(tok["tokenizer_model"])))
    found += [root / HF_SOURCE_DIR for root in (ckpt, iter_dir.parent)]
    return [p for p in found if p.is_dir() and any((p / name).is_file() for name in (
        "tokenizer.json", "tokenizer_config.json", "tiktoken.model"))]


def checkpoint_tokenizer(ckpt: Path, iter_dir: Path, run_config: dict[str, Any], explicit: Path | None = None) -> Any:
    """The checkpoint's own tokenizer (see the module's docstring), or ``explicit``."""
    from bridge_ext.tokenizers import load_tokenizer

    if explicit is not None:
        if not Path(explicit).is_dir():
            raise UserError(f"--tokenizer {explicit} is not a directory")
        return load_tokenizer(explicit)
    candidates = _tokenizer_candidates(Path(ckpt), Path(iter_dir), run_config)
    if not candidates:
        raise UserError(f"no tokenizer known for {ckpt} (no {iter_dir / 'tokenizer'}, no tokenizer directory in its "
                        "run config, no hf_source/); pass --tokenizer DIR with the model's tokenizer files")
    return load_tokenizer(candidates[0])


def check_fits(tokenizer: Any, vocab_size: int, what: str) -> None:
    """Refuse a tokenizer whose ids do not fit the model's vocabulary (another model's tokenizer)."""
    if tokenizer.vocab_size > vocab_size:
        raise UserError(f"the tokenizer in {tokenizer.directory} has {tokenizer.vocab_size:,} tokens but {what} has "
                        f"a vocabulary of {vocab_size:,}: it is another model's tokenizer; use the model's own")


@dataclass
class MegatronModel:
    """A loaded checkpoint: ``logits(ids)`` for a ``[batch, seq]`` tensor of token ids."""

    module: Any
    iter_dir: Path
    iteration: int
    vocab_size: int  # the model's own vocabulary (logits beyond it are Megatron's padding)
    context: int  # the sequence length it was trained on
    tokenizer: Any
    description: str

    def logits(self, ids: Any) -> Any:
        import torch

        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
        with torch.no_grad():
            out = self.module(input_ids=ids, position_ids=positions, attention_mask=None, runtime_gather_output=True)
        return out[..., : self.vocab_size].float()

    def session(self, batch: int) -> Any:
        """A decoding session with a KV cache for ``batch`` rows (:class:`KVSession`)."""
        return KVSession(self, batch)


class KVSession:
    """Decoding with megatron-core's own KV cache: its ``StaticInferenceContext`` passed to the model's forward.

    Each call feeds the next ``n`` positions of every row (``[batch, n]`` ids: the prompts' common prefix first,
    then one position at a time) and returns the logits of the last one (``[batch, vocab]``, Megatron's padding
    cut off). megatron-core's attention (``Attention._adjust_key_value_for_inference``, also MLA's) writes the new
    keys and values into the context's buffers at ``sequence_len_offset`` and attends to everything cached so far
    (its causal mask in the first pass, none after it); the model's forward computes only the last position's
    logits (``materialize_only_last_token_logits``). Rotary positions follow ``sequence_len_offset``.

    The buffers: megatron-core allocates them on ``torch.cuda.current_device()`` the first time a layer sees the
    context, which CPU mode does not redirect in that module; they are allocated here instead, on the model's
    device and in the shape megatron-core gives them (``[max_sequence, batch, query groups, key/value head size]``
    per layer, keyed by ``layer_number``), which megatron-core then uses as its own.
    """

    def __init__(self, model: MegatronModel, batch: int):
        import torch
        from megatron.core.inference.contexts import StaticInferenceContext
        from megatron.core.transformer.attention import Attention

        self.model = model
        self.context = StaticInferenceContext(batch, model.context)
        parameter = next(model.module.parameters())
        for layer in model.module.modules():
            if isinstance(layer, Attention):
                self.context.key_value_memory_dict[layer.layer_number] = tuple(
                    torch.zeros(model.context, batch, layer.num_query_groups_per_partition, size,
                                dtype=parameter.dtype, device=parameter.device)
                    for size in (layer.key_hidden_size, layer.val_hidden_size))
        if not self.context.key_value_memory_dict:
            raise UserError(f"{model.iter_dir}: the model has no megatron-core attention layer to cache")

    @property
    def position(self) -> int:
        return self.context.sequence_len_offset

    def __call__(self, ids: Any) -> Any:
        import torch

        start = self.context.sequence_len_offset
        if start + ids.shape[1] > self.context.max_sequence_length:
            raise UserError(f"decoding past the model's context ({self.context.max_sequence_length} tokens)")
        positions = torch.arange(start, start + ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
        with torch.no_grad():
            out = self.model.module(input_ids=ids, position_ids=positions, attention_mask=None,
                                    inference_context=self.context, runtime_gather_output=True)
        self.context.sequence_len_offset += ids.shape[1]
        return out[:, -1, : self.model.vocab_size].float()


@contextlib.contextmanager
def megatron_model(ckpt: str | Path, *, iteration: int | None = None, tokenizer: Path | None = None,
                   checksums: bool = True, verbose: bool = False, tp: int = 1) -> Iterator[MegatronModel]:
    """The checkpoint's model in this process (see the module's docstring), for the duration of the ``with``.
    ``tp`` > 1 (under torchrun, one tensor-parallel group of that many processes): this process's shard of it,
    loaded from the checkpoint whatever layout it was saved in; its logits are gathered over the group, so every
    process sees the whole vocabulary."""
    ckpt = Path(ckpt)
    iter_dir, number = open_checkpoint(ckpt, iteration, checksums=checksums)
    run_config = read_run_config(iter_dir)
    tok = checkpoint_tokenizer(ckpt, iter_dir, run_config, tokenizer)
    model_section = run_config["model"]
    vocab = model_section.get("vocab_size") or tok.vocab_size
    check_fits(tok, int(vocab), f"the model in {iter_dir}")
    from bridge_ext.convert.report import quiet_upstream

    with contextlib.ExitStack() as stack:
        with quiet_upstream(verbose=verbose), quiet_native_output(not verbose):
            loaded = _build(stack, iter_dir, number, run_config, tok, int(vocab), tp=tp)
        import torch

        with torch.no_grad():
            yield loaded


def _build(stack: contextlib.ExitStack, iter_dir: Path, number: int, run_config: dict[str, Any], tok: Any,
           vocab: int, *, tp: int = 1) -> MegatronModel:
    from bridge_ext.convert.megatron_ckpt import cause_line, load_model_weights
    from bridge_ext.convert.model import prepare_runtime
    from bridge_ext.convert.parallel import init_model_parallel, process_group

    cpu = prepare_runtime()
    stack.enter_context(process_group(cpu))
    provider = model_provider(run_config)
    if cpu:
        from bridge_ext.cpu import configure_for_cpu

        configure_for_cpu(provider)
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                 "expert_tensor_parallel_size", "context_parallel_size"):
        setattr(provider, name, 1)
    provider.tensor_model_parallel_size = provider.expert_tensor_parallel_size = tp
    provider.virtual_pipeline_model_parallel_size = None
    provider.sequence_parallel = False
    provider.perform_initialization = False
    provider.use_cpu_initialization = cpu
    provider.finalize()
    init_model_parallel(tp=tp, pp=1, ep=1, cpu=cpu)
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=cpu)
    try:
        load_model_weights(iter_dir, model)
    except UserError:
        raise
    except BaseException as exc:  # torch DCP's CheckpointException is a BaseException
        raise UserError(f"{iter_dir} does not load into the model its run config describes "
                        f"({cause_line(exc)})") from None
    module = model[0]
    module.eval()
    if not cpu:
        module.cuda()
    context = int(run_config["model"].get("seq_length") or provider.seq_length)
    name = type(provider).__name__.removesuffix('Provider').removesuffix('Model')
    return MegatronModel(module, iter_dir, number, vocab, context, tok,
                         f"{name} iteration {number} from {iter_dir}" + (f", TP{tp}" if tp > 1 else ""))


@contextlib.contextmanager
def quiet_native_output(enabled: bool) -> Iterator[None]:
    """Native writes to file descriptors 1 and 2 (gloo's "[Gloo] Rank 0 is connected ..." for every process
    group) go to a temporary file while the model is built; shown on stderr if building fails."""
    import os
    import sys
    import tempfile

    if not enabled:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        failed = None
        try:
            yield
        except BaseException as exc:
            failed = exc
            raise
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            if failed is not None and not isinstance(failed, UserError):
                sink.seek(0)
                os.write(2, sink.read()[-4000:])


@dataclass
class HFModel:
    module: Any
    path: Path
    vocab_size: int
    context: int
    tokenizer: Any
    description: str

    def logits(self, ids: Any, past: Any = None) -> tuple[Any, Any]:
        import torch

        with torch.no_grad():
            out = self.module(input_ids=ids, past_key_values=past, use_cache=True)
        return out.logits[..., : self.vocab_size].float(), out.past_key_values

    def session(self, batch: int) -> Any:
        """Decoding with transformers' KV cache (``past_key_values``); the same calls as :class:`KVSession`. Every
        row has the same length at every call, so no padding and no attention mask."""
        model = self

        class _Session:
            past = None
            position = 0

            def __call__(self, ids: Any) -> Any:
                logits, self.past = model.logits(ids, self.past)
                self.position += ids.shape[1]
                return logits[:, -1]

        return _Session()


def hf_model(path: str | Path, *, tokenizer: Path | None = None) -> HFModel:
    """A Hugging Face directory through transformers (safetensors only, no remote code: Kimi K2 configs map to
    DeepSeek-V3, :func:`bridge_ext.hf.load_hf_config`), in fp32 on CPU or the checkpoint's dtype on a GPU."""
    import os

    path = Path(path)
    if not (path / "config.json").is_file():
        raise UserError(f"--hf {path} is not a Hugging Face model directory (no config.json)")
    if not any(path.glob("*.safetensors")):
        raise UserError(f"--hf {path} has no safetensors weights (this package never loads pickled .bin files)")
    from bridge_ext.tokenizers import load_tokenizer

    tok = load_tokenizer(tokenizer if tokenizer is not None else path)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch
    from transformers import AutoModelForCausalLM

    from bridge_ext.hf import load_hf_config

    config = load_hf_config(path)
    check_fits(tok, int(config.vocab_size), f"the model in {path}")
    cuda = torch.cuda.is_available()
    module = AutoModelForCausalLM.from_pretrained(str(path), config=config, use_safetensors=True,
                                                  dtype="auto" if cuda else torch.float32,
                                                  trust_remote_code=False, local_files_only=True)
    module.eval()
    if cuda:
        module.cuda()
    context = int(getattr(config, "max_position_embeddings", 0) or 0)
    return HFModel(module, path, int(config.vocab_size), context, tok,
                   f"{type(module).__name__} from {path}")
