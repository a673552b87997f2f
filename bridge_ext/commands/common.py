"""What the ``nemo llm`` commands share: the command table's entry type, the parser, the options of the two
training commands, the resolve step (recipe + layout + preset + YAML + overrides), the dry run's summary and
``--to-yaml``'s write (rank checks and atomic writes: ``bridge_ext.runtime``). Imports neither torch nor Megatron
(the resolve step loads them).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from bridge_ext.errors import UserError
from bridge_ext.runtime import is_rank_zero, launcher_world_size, write_atomic

if TYPE_CHECKING:
    from bridge_ext.build import Resolved

__all__ = ["Command", "Parser", "add_training_arguments", "check_new_file", "error", "resolve",
           "run_line", "select_recipe", "show_or_write", "summary", "write_new_file"]

# ------------------------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class Command:
    """One ``nemo llm`` command: its parser and what runs it (``bridge_ext.commands.COMMANDS``)."""

    name: str
    add_parser: Callable[[Any, str], argparse.ArgumentParser]  # (the ``llm`` subparsers, name) -> its parser
    run: Callable[[argparse.Namespace], int]  # the parsed arguments -> exit code
    # "needed": without --recipe NAME it is our one-line error (unless one of `unless` is given), checked before
    # argparse; "argparse": argparse requires it; None: no recipe
    recipe: Literal["needed", "argparse"] | None = None
    unless: tuple[str, ...] = ()  # options that make --recipe unnecessary (finetune --list)
    nemo_run: str | None = None  # with this option and no --recipe, NeMo-Run's command of the same name


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, like every other bad input
        raise UserError(f"{message} (see `{self.prog} --help`)")

    def parse_known_args(self, args=None, namespace=None):
        """A command's ``key=value`` overrides may come before, between and after its options
        (``layout=cpu --dryrun train.train_iters=3``): argparse's intermixed parsing, for leaf commands."""
        if self._subparsers is not None or getattr(self, "_intermixing", False):
            return super().parse_known_args(args, namespace)
        self._intermixing = True  # parse_known_intermixed_args calls back into this method
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


def error(text: str) -> None:
    # one write of the whole line: under torchrun every rank prints it into the same pipe, and print()'s separate
    # write of the newline let another rank's line land in between ("...sizeserror: ...")
    sys.stderr.write(f"error: {text}\n")
    sys.stderr.flush()


# -------------------------------------------------------------------------------------------- writing
def check_new_file(path: str | Path | None, *, overwrite: bool) -> None:
    """Refuse an existing ``--to-yaml`` target before anything slow runs."""
    if path and Path(path).exists() and not overwrite:
        raise UserError(f"{path} exists; pass --overwrite to replace it")


def write_new_file(path: Path, text: str, *, overwrite: bool) -> None:
    """``--to-yaml``'s write: refused when ``path`` exists (without ``overwrite``) or its directory does not;
    atomic (a reader sees the old file or the whole new one)."""
    check_new_file(path, overwrite=overwrite)
    if not path.parent.exists():
        raise UserError(f"directory {path.parent} does not exist")
    write_atomic(path, text)


# ------------------------------------------------------------------------------ pretrain and finetune
def add_training_arguments(p: argparse.ArgumentParser, *, preset_help: str, overrides_help: str) -> None:
    """The options ``pretrain`` and ``finetune`` share (precedence: recipe < --yaml < key=value)."""
    p.add_argument("--layout", help="a layout name from the recipe's list (default: its first); or layout=NAME")
    p.add_argument("--preset", help=preset_help)
    p.add_argument("--yaml", help="YAML file of config values (full dump or partial)")
    p.add_argument("--dryrun", action="store_true", help="validate, print a summary and the resolved YAML")
    p.add_argument("--to-yaml", metavar="FILE", help="write the resolved config to FILE and exit")
    p.add_argument("--overwrite", action="store_true", help="let --to-yaml replace an existing file")
    p.add_argument("--device", choices=("auto", "gpu", "cpu"), default="auto",
                   help="auto: CPU mode when no GPU is visible")
    p.add_argument("--init", choices=("by-name", "upstream"), default="by-name",
                   help="by-name: each weight drawn from the seed and its name, the same in every layout; upstream: "
                        "megatron-core's per-rank draws (docs/cpu.md)")
    p.add_argument("--no-checksums", dest="checksums", action="store_false",
                   help="saves write no integrity record and a resume checks none (docs/checkpoints.md: its cost)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=overrides_help)


def select_recipe(args: argparse.Namespace, get: Callable[[str], Any]) -> Any:
    """``args.recipe`` by ``get`` with its preset (``recipes.selection.choose_recipe``); ``preset=NAME`` /
    ``layout=NAME`` overrides move onto ``args``."""
    from recipes.selection import choose_recipe

    recipe, args.layout, args.overrides = choose_recipe(args.recipe, get=get, preset=args.preset, layout=args.layout,
                                                        overrides=args.overrides)
    return recipe


def resolve(args: argparse.Namespace, *, get: Callable[[str], Any]) -> Resolved:
    """The recipe (:func:`select_recipe`), then ``bridge_ext.build.resolve`` for the command's layout, YAML and
    overrides, with progress on stderr while Megatron loads. An existing ``--to-yaml`` target is refused first.
    Validation uses the layout's GPU count, or the launcher's world size when training."""
    recipe = select_recipe(args, get)
    check_new_file(args.to_yaml, overwrite=args.overwrite)
    layout = recipe.layout(args.layout)
    training = not (args.dryrun or args.to_yaml)
    if args.yaml:  # fail before the slow imports
        from bridge_ext.overrides import load_yaml_file

        load_yaml_file(args.yaml)
    from rich.console import Console

    with Console(stderr=True, quiet=not is_rank_zero()).status(f"building {recipe.name} ({layout.cluster}) ..."):
        from bridge_ext.build import resolve as build

        return build(recipe, layout=args.layout, yaml_path=args.yaml, overrides=args.overrides,
                     gpus=(launcher_world_size() if training else None) or layout.gpus, training=training)


def show_or_write(resolved: Resolved, args: argparse.Namespace, *, task_lines: list[str] = ()) -> None:
    """``--to-yaml``: write the resolved config; ``--dryrun``: print the summary and the YAML (a command calls it
    for those two only: a training run hands its config on without coming back here)."""
    from bridge_ext.overrides import config_to_yaml

    text = config_to_yaml(resolved.cfg)
    if args.to_yaml:
        write_new_file(Path(args.to_yaml), text, overwrite=args.overwrite)
        print(f"wrote {args.to_yaml} ({resolved.recipe.name}, layout {resolved.layout.cluster})", file=sys.stderr)
        return
    print(summary(resolved, task_lines=task_lines))
    print("---")
    print(text, end="")


def run_line(*, tokens_per_step: int, train_iters: int, warmup_iters: float, decay_start: int | None,
             total_tokens: int) -> str:
    decay = f", decay after iteration {decay_start:,}" if decay_start is not None else ""
    units = ((1e12, "T "), (1e9, "B "), (1e6, "M "), (1e3, "k "), (1, ""))
    scale, unit = next((scale, unit) for scale, unit in units if total_tokens >= scale)
    return (f"{train_iters:,} iterations x {tokens_per_step:,} tokens per step = {total_tokens / scale:.4g} "
            f"{unit}tokens; warm-up {warmup_iters:,.4g} steps{decay}")


def summary(resolved: Resolved, *, task_lines: list[str] = ()) -> str:
    """The dry run's summary of the validated config; ``task_lines`` (fine-tuning) follow the recipe line and
    replace the data line."""
    from recipes.optimizers import is_muon

    recipe, cfg = resolved.recipe, resolved.checked
    m, o, t = cfg.model, cfg.optimizer, cfg.train
    gpus = cfg.data_parallel_size * m.tensor_model_parallel_size * m.pipeline_model_parallel_size \
        * m.context_parallel_size
    parallel = (f"TP{m.tensor_model_parallel_size} PP{m.pipeline_model_parallel_size}"
                f" VP{m.virtual_pipeline_model_parallel_size or 1} EP{m.expert_model_parallel_size}"
                f" ETP{m.expert_tensor_parallel_size or 1} CP{m.context_parallel_size}"
                f" DP{cfg.data_parallel_size} on {gpus} GPUs")
    muon = ", ".join(f"{k.removeprefix('muon_')}={getattr(o, k)}" for k in vars(o)
                     if k.startswith("muon_") and k != "muon_coefficient_type")  # printed below: what runs
    lines = [
        f"recipe      {recipe.name} (layout {resolved.layout.cluster}, optimizer preset {recipe.preset.name})",
        *task_lines,
        f"model       {type(m).__name__}: {m.num_layers} layers, hidden {m.hidden_size}"
        + (f", {m.num_moe_experts} experts top-{m.moe_router_topk}" if m.num_moe_experts else ""),
        f"parallel    {parallel}",
        f"batch       global {t.global_batch_size}, micro {t.micro_batch_size}, seq {m.seq_length}, "
        f"{t.train_iters} iterations",
        f"precision   {cfg.mixed_precision or 'fp32'}",
        f"optimizer   {o.optimizer} lr={o.lr} min_lr={o.min_lr} wd={o.weight_decay} clip={o.clip_grad}",
    ]
    if is_muon(o.optimizer):
        from bridge_ext.muon.presets import ns_coefficients_of

        lines.append(f"muon        {muon}, coefficients={ns_coefficients_of(recipe.preset, cfg)}, "
                     f"split_gate_up={recipe.preset.split_gate_up}")
    if getattr(m, "qk_clip", False):
        lines.append(f"qk-clip     threshold {m.qk_clip_threshold}, alpha {m.qk_clip_alpha}")
    from bridge_ext.build import benchmark_only_fields

    for name, doc in benchmark_only_fields().items():
        if getattr(m, name, None):
            lines.append(f"benchmark   {name}={getattr(m, name)}: throughput only, do not keep the weights "
                         f"(megatron-core: \"{doc}\")")
    # a model's tokenizer directory: fits the model? A blend, whatever the tokenizer: its files, its splits
    if cfg.tokenizer.tokenizer_type == "HuggingFaceTokenizer" or getattr(cfg.dataset, "blend", None) or \
            getattr(cfg.dataset, "blend_per_split", None):
        from bridge_ext.corpus import check_real_data

        described = check_real_data(cfg)
        if described:
            lines.append(f"tokenizer   {described}")
    if not task_lines:  # fine-tuning's task lines name its data
        lines.append(_data_line(recipe, cfg))
    lines += stack_lines(muon=is_muon(o.optimizer), lora=getattr(cfg, "peft", None) is not None)
    sch = cfg.scheduler
    from recipes.budget import run_length

    warmup = f"{sch.lr_warmup_iters:,} steps" if sch.lr_warmup_iters else f"{sch.lr_warmup_fraction or 0:.4%} of decay"
    if t.train_iters:  # iteration-based (sample-based runs have no fixed tokens per iteration count here)
        run = run_length(global_batch_size=t.global_batch_size, seq_length=m.seq_length, train_iters=t.train_iters,
                         lr_warmup_iters=sch.lr_warmup_iters, lr_warmup_fraction=sch.lr_warmup_fraction,
                         lr_decay_iters=sch.lr_decay_iters, lr_decay_style=sch.lr_decay_style,
                         lr_wsd_decay_iters=sch.lr_wsd_decay_iters)
        lines.append(f"run         {run_line(**run.as_dict())}")
        warmup = f"{run.warmup_iters:,.4g} steps"
    wsd = sch.lr_decay_style == "WSD" and sch.lr_wsd_decay_iters
    decay = f", final {sch.lr_wsd_decay_iters:,} iterations {sch.lr_wsd_decay_style}" if wsd else ""
    lines.append(f"schedule    {sch.lr_decay_style}: warm-up {warmup}{decay}; weight decay "
                 f"{sch.start_weight_decay}->{sch.end_weight_decay}")
    return "\n".join(lines)


def stack_lines(*, muon: bool, lora: bool) -> list[str]:
    """The installed Megatron stack and the upstream fixes (bridge_ext/patches) a run of this config applies on it:
    what a run on this stack changes upstream, so that the same dry run on another container says what differs."""
    from bridge_ext.patches import applied_here
    from bridge_ext.stack import describe_stack

    cpu = sys.modules.get("bridge_ext.cpu")  # CPU mode is on only in a process that imported it and switched it on
    scopes = ["import", "config", "stack", "checkpointing"]
    scopes += ["muon"] * muon + ["lora"] * lora + ["lora-muon"] * (lora and muon)
    scopes += ["cpu"] * bool(cpu is not None and cpu.cpu_mode_active())
    fixes = applied_here(scopes)
    return [f"stack       {describe_stack()}",
            f"fixes       {len(fixes)} upstream fixes apply here ({', '.join(fixes) or 'none'}; docs/patches.md)"]


def _data_line(recipe: Any, cfg: Any) -> str:
    if cfg.dataset.blend:
        return f"data        dataset.blend={cfg.dataset.blend}"
    if recipe.model.proxy_of:
        return "data        the standard-library text corpus, prepared when training starts (--data mock: mock)"
    return "data        mock data (NullTokenizer); set dataset.blend and the tokenizer for real data"
