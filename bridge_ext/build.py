"""Recipe -> Megatron Bridge ``ConfigContainer``: the one pipeline of pre-training and fine-tuning.

:func:`template` (Megatron Bridge's template for the recipe's task: pretrain, sft or lora, with the recipe's
model, layout and optimizer preset) -> the recipe's own overrides -> ``--yaml`` -> ``key=value`` overrides ->
what follows from them (:func:`derived_values`: the token budget's iterations, the preset's schedule fractions),
derived once for the values nobody set -> :func:`validate_for_layout`. :func:`resolve` is the whole of it.

The model comes from the recipe's shipped HF ``config.json`` through ``AutoBridge`` (no hub id, no
weights); the base template, optimizer and scheduler configs are Megatron Bridge's own classes.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from bridge_ext import patches
from bridge_ext.errors import UserError
from bridge_ext.hf import apply_config_stated_fields, load_hf_config
from bridge_ext.upstream_output import megatron_warnings_once, quiet_megatron
from bridge_ext.muon import checks as muon_checks

if TYPE_CHECKING:
    from megatron.bridge.training.config import ConfigContainer

    from recipes import Layout, Recipe

__all__ = ["Resolved", "Task", "benchmark_only_fields", "build_config", "derived_values", "megatron_warnings_once",
           "model_provider", "quiet_megatron", "resolve", "resolve_for_run", "task_of", "template",
           "validate_for_layout"]

Task = Literal["pretrain", "sft", "lora"]

OUTPUT_ROOT = "nemo_experiments"  # relative, so resolved YAML is the same on every machine


def model_provider(recipe: Recipe):
    """Megatron provider for the recipe's model, from its shipped HF config (no weights)."""
    patches.apply("import")
    from megatron.bridge import AutoBridge

    hf_config = load_hf_config(recipe.model.config_dir)
    provider = AutoBridge.from_hf_config(hf_config).to_megatron_provider(load_weights=False)
    apply_config_stated_fields(provider, hf_config)
    for key, value in recipe.model.provider.items():  # what the model's authors set beyond its config.json
        setattr(provider, key, value)
    spec = provider.transformer_layer_spec
    if isinstance(spec, functools.partial) and "use_transformer_engine" in spec.keywords:
        # megatron/bridge/models/deepseek/deepseek_v3_bridge.py:51 bakes the *building* machine's TE
        # availability into the spec; a recipe targets GPUs with TE wherever it is built (CPU mode
        # switches to the local spec itself).
        provider.transformer_layer_spec = functools.partial(spec.func, *spec.args,
                                                            **{**spec.keywords, "use_transformer_engine": True})
    # megatron/bridge/models/gpt_provider.py:186 defaults this to "is the fused kernel importable here";
    # the GPU target has it (CPU mode turns it off).
    provider.gradient_accumulation_fusion = True
    if provider.num_moe_experts:
        # TE's fused token permutation: megatron-bridge 0.3.1's bridges turn it on, 0.3.0's DeepSeek-V3
        # provider leaves it off; the GPU target has TE (CPU mode turns it off).
        provider.moe_permute_fusion = True
    return provider


def _apply_layout(cfg: ConfigContainer, layout: Layout) -> None:
    import torch

    model = cfg.model
    model.tensor_model_parallel_size = layout.tp
    model.pipeline_model_parallel_size = layout.pp
    model.virtual_pipeline_model_parallel_size = layout.vp
    model.expert_model_parallel_size = layout.ep
    model.expert_tensor_parallel_size = layout.etp
    model.context_parallel_size = layout.cp
    model.sequence_parallel = layout.sequence_parallel
    model.pipeline_dtype = (torch.float32 if layout.precision == "fp32" else torch.bfloat16) if layout.pp > 1 else None
    model.pipeline_model_parallel_layout = layout.pipeline_layout
    if layout.pipeline_layout:  # an explicit layout replaces the embedding/loss accounting heuristics
        model.account_for_embedding_in_pipeline_split = False
        model.account_for_loss_in_pipeline_split = False
    model.seq_length = layout.seq_length
    for key, value in layout.model.items():
        if not hasattr(model, key):
            raise AttributeError(f"layout {layout.cluster} sets unknown provider field {key}")
        setattr(model, key, copy.deepcopy(value))
    cfg.dataset.seq_length = layout.seq_length
    cfg.train.micro_batch_size = layout.micro_batch_size
    cfg.train.global_batch_size = layout.global_batch_size
    cfg.mixed_precision = None if layout.precision == "fp32" else layout.precision


def _apply_preset(cfg: ConfigContainer, recipe: Recipe) -> None:
    """The preset's optimizer, scheduler, DDP and model fields: recipe values, which overrides may change."""
    from megatron.bridge.training.config import OptimizerConfig, SchedulerConfig

    from bridge_ext.muon.presets import apply_preset
    from bridge_ext.upstream_api import installed_optimizer_fields

    preset = recipe.preset
    fields = installed_optimizer_fields(preset.name, preset.optimizer)  # the installed release's names
    bf16 = isinstance(cfg.mixed_precision, str) and cfg.mixed_precision.startswith("bf16")
    cfg.optimizer = OptimizerConfig(**fields, bf16=bf16, fp16=False)
    cfg.scheduler = SchedulerConfig(**preset.scheduler)
    for key, value in preset.ddp.items():
        setattr(cfg.ddp, key, value)
    apply_preset(cfg, preset, runtime=False)  # QK-clip and other model-level fields (run-time parts: training.py)


def task_of(recipe: Recipe) -> Task:
    """``pretrain`` for ``recipes.Recipe``, the fine-tuning recipe's mode (``sft``, ``lora``) otherwise."""
    return getattr(recipe, "mode", "pretrain")


def template(recipe: Recipe, *, layout: str | None = None) -> ConfigContainer:
    """The recipe's values on Megatron Bridge's template for its task, before any override and with nothing
    derived: ``pretrain`` (``_pretrain_common``), ``sft`` (``_sft_common``) or ``lora`` (``_peft_common``),
    the model from the shipped HF config, the layout, the optimizer preset, the run's directories."""
    from bridge_ext.upstream_api import finetune_template, pretrain_template

    chosen = recipe.layout(layout)
    problems = chosen.problems(recipe.model.num_layers)
    if problems:
        raise UserError(f"layout {chosen.cluster} does not fit {recipe.model.display}: {'; '.join(problems)}")
    task = task_of(recipe)
    cfg = pretrain_template() if task == "pretrain" else finetune_template(task)
    cfg.model = model_provider(recipe)
    if task != "pretrain":
        from bridge_ext.finetune.config import finetune_dataset

        cfg.dataset = finetune_dataset(recipe, chosen)
    _apply_layout(cfg, chosen)
    _apply_preset(cfg, recipe)
    cfg.train.train_iters = recipe.train_iters(chosen)  # the model's token budget, else the template's length
    if task == "pretrain":
        # Mock data by default: NullTokenizer over the model's vocabulary. Real data: set dataset.blend and
        # the tokenizer (see docs/recipes.md).
        cfg.tokenizer.tokenizer_type = "NullTokenizer"
        cfg.tokenizer.tokenizer_model = None
        cfg.tokenizer.vocab_size = cfg.model.vocab_size
        # The model's vocabulary is the HF config's on every stack: megatron-bridge 0.6's template sets
        # use_tokenizer_vocab_size, with which setup() replaces it by the tokenizer's and pads that to a multiple
        # of make_vocab_size_divisible_by x TP (training/setup.py _validate_and_set_vocab_size: Kimi K2's proxy
        # 4096 -> 5120 rows); earlier releases keep a model vocabulary that is set.
        if hasattr(cfg.tokenizer, "use_tokenizer_vocab_size"):
            cfg.tokenizer.use_tokenizer_vocab_size = False
    else:
        from bridge_ext.finetune.config import finetune_tokenizer_dir, lora_config

        cfg.peft = lora_config(recipe)
        cfg.tokenizer.tokenizer_type = "HuggingFaceTokenizer"
        cfg.tokenizer.tokenizer_model = finetune_tokenizer_dir(recipe)
    run_dir = f"{OUTPUT_ROOT}/{recipe.name}"
    cfg.checkpoint.save = cfg.checkpoint.load = f"{run_dir}/checkpoints"
    if task != "pretrain":
        cfg.checkpoint.pretrained_checkpoint = None  # --hf DIR or checkpoint.pretrained_checkpoint=DIR
    # Slurm (time limit, preemption) and torchrun send SIGTERM before SIGKILL: save, then exit 0. The data
    # loader workers must survive that signal too, or their death ends the trainer before it saves.
    cfg.train.exit_signal_handler = True
    cfg.train.exit_signal_handler_for_dataloader = True
    cfg.logger.tensorboard_dir = f"{run_dir}/tb_logs"
    return cfg


def derived_values(cfg: ConfigContainer, recipe: Recipe, *, explicit: Collection[str] = ()) -> dict[str, Any]:
    """What follows from the other values (dotted key -> value), for what ``explicit`` and the recipe leave unset.

    Pre-training a model with a published token budget trains it at the config's batch and sequence length
    (``train.train_iters``); the preset's schedule fractions become iteration counts
    (``recipes.budget.derived_schedule``, as ``nemo llm info`` derives them). Reads ``cfg``, changes nothing.
    """
    from recipes.budget import derived_schedule, iters_for_tokens, tokens_per_step

    explicit = {*recipe.overrides, *explicit}
    out: dict[str, Any] = {}
    tokens, t = recipe.model.pretrain_tokens, cfg.train
    if (task_of(recipe) == "pretrain" and tokens and "train.train_iters" not in explicit and t.global_batch_size
            and cfg.model.seq_length):
        out["train.train_iters"] = iters_for_tokens(tokens, tokens_per_step(t.global_batch_size, cfg.model.seq_length))
    train_iters = out.get("train.train_iters", t.train_iters)
    schedule = derived_schedule(cfg.scheduler, recipe.preset, train_iters=train_iters, explicit=explicit)
    out.update({f"scheduler.{name}": value for name, value in schedule.items()})
    return out


def resolve_for_run(cfg: ConfigContainer, recipe: Recipe, *, explicit: Collection[str] = ()) -> dict[str, Any]:
    """Set :func:`derived_values` on ``cfg``, once, after every override; returns them.

    ``explicit``: the dotted keys the user set (``--yaml``, ``key=value``); the recipe's own overrides count too.
    """
    from bridge_ext.overrides import set_dotted

    values = derived_values(cfg, recipe, explicit=explicit)
    for dotted, value in values.items():
        set_dotted(cfg, dotted, value)
    return values


def build_config(recipe: Recipe, *, layout: str | None = None, yaml_path: str | Path | None = None,
                 overrides: Sequence[str] = (), values: Mapping[str, Any] | None = None) -> ConfigContainer:
    """The recipe's full ``ConfigContainer`` on the named layout (default: the recipe's first), one pass:

    template (:func:`template`) -> the recipe's own overrides -> ``yaml_path`` -> ``overrides`` (``a.b=value``)
    -> ``values`` (dotted key -> value, from code) -> what follows from them (:func:`resolve_for_run`).
    Every value set on the way is explicit; only the others are derived.
    """
    from bridge_ext.overrides import apply_user_overrides, set_dotted

    cfg = template(recipe, layout=layout)
    patches.apply("config")  # the YAML this config writes can be read back (yaml-signal-target)
    for dotted, value in recipe.overrides.items():
        set_dotted(cfg, dotted, value)
    explicit: set[str] = set()
    if yaml_path is not None or overrides:
        explicit |= apply_user_overrides(cfg, yaml_path=yaml_path, overrides=list(overrides),
                                         derived=derived_values(cfg, recipe))
    for dotted, value in (values or {}).items():
        set_dotted(cfg, dotted, value)
        explicit.add(dotted)
    if "checkpoint.save" in explicit and "checkpoint.load" not in explicit:
        cfg.checkpoint.load = cfg.checkpoint.save  # rerunning the command resumes the run it saved
    resolve_for_run(cfg, recipe, explicit=explicit)
    return cfg


@dataclass(frozen=True)
class Resolved:
    """A recipe resolved for a run: the config that trains and its copy validated for the run's ranks."""

    recipe: Recipe
    layout: Layout
    cfg: ConfigContainer
    checked: ConfigContainer  # validated (finalized) deep copy; data_parallel_size for the run's ranks


def resolve(recipe: Recipe, *, layout: str | None = None, yaml_path: str | Path | None = None,
            overrides: Sequence[str] = (), gpus: int | None = None, training: bool = False) -> Resolved:
    """The pipeline of ``nemo llm pretrain`` and ``finetune``: :func:`build_config` (recipe -> ConfigContainer ->
    YAML -> overrides -> derived values, once), then :func:`validate_for_layout` for ``gpus`` ranks (default: the
    layout's). ``training``: Megatron's warnings stay visible (each once); otherwise they are silenced."""
    if training:
        megatron_warnings_once()
    else:
        quiet_megatron()
    chosen = recipe.layout(layout)
    cfg = build_config(recipe, layout=layout, yaml_path=yaml_path, overrides=overrides)
    checked = validate_for_layout(cfg, gpus=gpus or chosen.gpus,
                                  max_positions=recipe.model.hf_config.get("max_position_embeddings"))
    return Resolved(recipe=recipe, layout=chosen, cfg=cfg, checked=checked)


_PARALLEL_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                   "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size")


def _size_problems(cfg: ConfigContainer) -> list[str]:
    """Sizes and iteration counts that are missing or not positive (every later check divides by them)."""
    m, t = cfg.model, cfg.train
    required = [("train.global_batch_size", t.global_batch_size), ("train.micro_batch_size", t.micro_batch_size),
                ("model.seq_length", m.seq_length)]
    optional = [("train.train_iters", t.train_iters), ("train.train_samples", t.train_samples),
                *((f"model.{name}", getattr(m, name)) for name in _PARALLEL_SIZES)]
    out = [f"{name} must be set" for name, value in required if value is None]
    out += [f"{name} must be a positive integer, got {value}" for name, value in required + optional
            if value is not None and value < 1]
    if t.train_iters is None and t.train_samples is None:
        out.append("set train.train_iters (or train.train_samples)")
    return out


def _launch_problems(cfg: ConfigContainer, gpus: int, max_positions: int | None) -> list[str]:
    """What Megatron refuses at launch on ``gpus`` ranks, before the model or the process groups exist."""
    m, t = cfg.model, cfg.train
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    if gpus % (tp * pp * cp):
        return [f"{gpus} GPUs are not divisible by model.tensor_model_parallel_size {tp} x "
                f"pipeline_model_parallel_size {pp} x context_parallel_size {cp} = {tp * pp * cp}"]
    out = []
    ep, etp = m.expert_model_parallel_size, m.expert_tensor_parallel_size or tp
    if gpus % (etp * ep * pp):  # parallel_state.initialize_model_parallel's expert decomposition
        out.append(f"model.expert_model_parallel_size {ep} x expert_tensor_parallel_size {etp} x "
                   f"pipeline_model_parallel_size {pp} = {etp * ep * pp} does not divide {gpus} GPUs")
    if m.num_moe_experts and m.num_moe_experts % ep:  # asserted when the MoE layer is built (moe_layer.py)
        out.append(f"model.num_moe_experts {m.num_moe_experts} is not divisible by "
                   f"model.expert_model_parallel_size {ep}")
    if m.num_moe_experts and ep == 1 and etp != tp:
        # Trains wrong without an error, on any device: megatron-core 0.16 marks expert weights as dense
        # (`allreduce`) when EP is 1 (tensor_parallel/layers.py `not (self.is_expert and self.expert_parallel)`,
        # expert_parallel = EP > 1; TE's grouped linear alike), so DDP reduces their gradients over the dense
        # data-parallel group, while the experts' tokens were split over the TP ranks that ETP != TP leaves out
        # of it (expert weights 1e-3 off a 1-process run after one step, measured on CPU at TP2 ETP1 EP1).
        out.append(f"model.expert_tensor_parallel_size {etp} with tensor_model_parallel_size {tp} and "
                   f"expert_model_parallel_size 1 trains the experts wrong (megatron-core reduces their gradients "
                   f"over data-parallel ranks only); set model.expert_tensor_parallel_size={tp} or "
                   f"model.expert_model_parallel_size > 1")
    out += muon_checks.launch_problems(cfg)  # upstream Muon / QK-clip bugs the installed code has
    if max_positions and m.seq_length > max_positions:  # RoPE would run, on positions the model never had
        out.append(f"model.seq_length {m.seq_length} exceeds the model's max_position_embeddings {max_positions}")
    from bridge_ext.upstream_api import batch_split_calculator

    try:  # the calculator Megatron Bridge's initialize builds at launch
        batch_split_calculator(global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size,
                               data_parallel_size=gpus // (tp * pp * cp),
                               decrease_batch_size_if_needed=t.decrease_batch_size_if_needed,
                               rampup_batch_size=t.rampup_batch_size)
    except AssertionError as exc:
        out.append(f"train.global_batch_size: {' '.join(str(exc).split())} ({gpus} GPUs)")
    return out


def validate_for_layout(cfg: ConfigContainer, *, gpus: int, max_positions: int | None = None) -> ConfigContainer:
    """Check ``cfg`` as Megatron would when launched on ``gpus`` ranks; returns the validated copy.

    First what Megatron refuses only at launch (sizes, the batch split, expert counts) and a sequence
    longer than the model's ``max_positions`` (its HF config's ``max_position_embeddings``), then
    Megatron Bridge's ``ConfigContainer.validate()``, which runs ``TransformerConfig.__post_init__`` (heads
    and query groups vs TP, layers vs PP/VP or the pipeline layout string). Validation mutates (finalizes)
    the config, so it runs on a deep copy. Checks that need the GPU or Transformer Engine on *this* machine
    are skipped when they are absent (``bridge_ext.validation.validation_without_gpu``). Every problem is a
    ``UserError``.
    """
    from bridge_ext.validation import validation_without_gpu
    from bridge_ext.upstream_api import mixed_precision_for_validate, sft_root_for_validate

    problems = _size_problems(cfg) or _launch_problems(cfg, gpus, max_positions)
    if problems:
        raise UserError("; ".join(problems))
    checked = copy.deepcopy(cfg)
    m = checked.model
    checked.data_parallel_size = gpus // (m.tensor_model_parallel_size * m.pipeline_model_parallel_size
                                          * m.context_parallel_size)
    if checked.comm_overlap is not None:
        checked.comm_overlap.data_parallel_size = checked.data_parallel_size
    try:
        with validation_without_gpu(checked), mixed_precision_for_validate(checked), sft_root_for_validate(checked):
            checked.validate()
    except (AssertionError, ValueError, TypeError) as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        raise UserError(f"the config does not validate: {message}") from None
    _check_layer_split(checked.model)
    return checked


def _check_layer_split(model) -> None:
    """Layers over pipeline (and virtual) stages, as each rank will split them when it builds its model.

    ``TransformerConfig`` checks a pipeline layout string and uneven splits; an even split is asserted only
    in ``get_num_layers_to_build`` (``transformer_block.py``), which is called here for every stage.
    """
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    pp, vp = model.pipeline_model_parallel_size, model.virtual_pipeline_model_parallel_size
    if pp == 1 or model.pipeline_model_parallel_layout is not None:
        return
    try:
        for rank in range(pp):
            for stage in range(vp) if vp else (None,):
                get_num_layers_to_build(model, vp_stage=stage, pp_rank=rank)
    except AssertionError as exc:
        raise UserError(f"model.num_layers {model.num_layers} over pipeline_model_parallel_size {pp} x "
                        f"virtual_pipeline_model_parallel_size {vp or 1}: {' '.join(str(exc).split())}") from None


@functools.cache
def benchmark_only_fields() -> dict[str, str]:
    """Provider fields megatron-core documents as for benchmarking only: name -> its documentation.

    Read from the installed ``TransformerConfig`` (and its base classes) source: a field's docstring is
    the string right after its annotated assignment. A training layout must leave these at their defaults.
    """
    import ast
    import inspect
    import re
    import textwrap

    from megatron.core.transformer.transformer_config import TransformerConfig

    out = {}
    for cls in TransformerConfig.__mro__[:-1]:
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
        for node, doc in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                    and isinstance(doc.value.value, str) and re.search(r"benchmark", doc.value.value, re.I)):
                out.setdefault(node.target.id, " ".join(doc.value.value.split()))
    return out
