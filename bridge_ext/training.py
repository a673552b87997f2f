"""From a resolved config to Megatron Bridge's ``pretrain()``: the one path ``nemo llm pretrain``, ``finetune``
and ``compare`` share (device choice, data, stack fixes, CPU mode, preset run-time parts, callbacks).

The config arrives resolved (``bridge_ext.build.build_config``: every override applied, derived values set
once); nothing here changes a value for GPUs except the data.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from bridge_ext.errors import UserError
from bridge_ext.runtime import is_last_rank, is_rank_zero, world_size

if TYPE_CHECKING:
    from recipes import Recipe

__all__ = ["CPU_PARAM_LIMIT", "Prepared", "loss_recorder", "prepare", "read_losses", "read_records",
           "records_losses_here", "run_pretrain", "train", "write_loss_curve"]

Device = Literal["auto", "gpu", "cpu"]
Data = Literal["auto", "text", "mock"]

CPU_PARAM_LIMIT = 2e9  # CPU mode is for proxies; anything bigger would take days or run out of memory


@dataclass
class Prepared:
    use_cpu: bool
    data: str  # one line for the console
    callbacks: list[Any] = field(default_factory=list)


def prepare(recipe: Recipe, cfg: Any, *, device: Device = "auto", data: Data = "auto", quiet: bool = False,
            telemetry: bool = True) -> Prepared:
    """Make ``cfg`` ready to train on this machine; nothing here changes a config for GPUs except data.

    ``data``: ``text`` trains on the shipped standard-library corpus (``nemo llm prepare-data``), ``mock`` on
    Megatron's mock data; ``auto`` is text for proxy recipes whose ``dataset.blend`` is unset, else the config's.
    """
    import torch

    from bridge_ext import patches

    if device == "gpu" and not torch.cuda.is_available():
        raise UserError("--device gpu but no GPU is visible; use --device cpu for proxy recipes")
    use_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if use_cpu and recipe.model.params.total > CPU_PARAM_LIMIT:
        raise UserError(
            f"{recipe.name} has {recipe.model.params.total / 1e9:.1f} B parameters and no GPU is visible; "
            "CPU mode is for tiny proxy recipes (see `nemo llm recipes`), or launch on GPUs with torchrun"
        )
    blend = getattr(cfg.dataset, "blend", None)  # fine-tuning datasets have none: they keep their own data
    description = (f"dataset.blend={blend}" if blend else "mock data (NullTokenizer)") if hasattr(cfg.dataset, "blend") \
        else f"fine-tuning data {getattr(cfg.dataset, 'dataset_root', None)}"
    if data == "text" or (data == "auto" and recipe.model.proxy_of is not None and hasattr(cfg.dataset, "blend")
                          and blend is None):
        from bridge_ext.data import use_text_corpus

        description = use_text_corpus(cfg, quiet=quiet)
    if getattr(cfg.tokenizer, "tokenizer_type", None) == "HuggingFaceTokenizer" and hasattr(cfg.dataset, "blend"):
        from bridge_ext.corpus import check_real_data
        from bridge_ext.tokenizers import use_megatron_tokenizer

        check_real_data(cfg)  # the tokenizer fits the model; the blend exists and was made with this tokenizer
        use_megatron_tokenizer(cfg, quiet=quiet)  # a Kimi K2 (tiktoken) directory: converted once, no remote code
    patches.apply("stack")  # megatron-core 0.16 + emerging-optimizers 0.3.0 need them on GPUs too
    if use_cpu:
        from bridge_ext import cpu

        cpu.enable_cpu_mode()
        note = cpu.configure_for_cpu(cfg)
        if note and not quiet and is_rank_zero():
            print(note, file=sys.stderr, flush=True)
        cfg.dataset.num_workers = 0  # the batches are tiny; loader processes only compete for the cores
    else:
        from bridge_ext.stack import have_transformer_engine

        if not have_transformer_engine():  # a bare PyTorch image: the local spec on the GPU (bridge_ext.without_te)
            from bridge_ext.without_te import TE_FREE_PATCHES, configure_without_te

            note = configure_without_te(cfg)
            patches.apply("cpu", only=TE_FREE_PATCHES)  # MLA and MoE modules built without TE
            if not quiet and is_rank_zero():
                print(note, file=sys.stderr, flush=True)
    from bridge_ext.muon.attention_logits import QKClipTracking, use_kernel_max_logit
    from bridge_ext.muon import MuonTelemetry
    from bridge_ext.muon.presets import install_preset

    install_preset(recipe.preset)  # Newton-Schulz coefficients and the MuonClip fix (its config values: build.py)
    callbacks: list[Any] = []
    if telemetry and recipe.preset.kind == "muon":
        if not use_cpu:
            use_kernel_max_logit(cfg)  # TE measures the max logit in its kernel: no hook computes it
        callbacks.append(MuonTelemetry(interval=cfg.logger.log_interval))  # also keeps QK-clip's running max
    elif cfg.model.qk_clip:  # QK-clip needs the step's max over every micro-batch, telemetry or not
        callbacks.append(QKClipTracking())
    return Prepared(use_cpu=use_cpu, data=description, callbacks=callbacks)


def run_pretrain(cfg: Any, prepared: Prepared, *, callbacks: list[Any] = ()) -> bool:
    """Megatron Bridge's ``pretrain()`` with its GPT ``forward_step``, kill-safe (``bridge_ext.kill_safe``).

    Returns True when the run stopped early on its exit signal (SIGTERM) after saving, False otherwise.
    """
    import torch
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    from bridge_ext import kill_safe, patches

    patches.apply("checkpointing")  # atomic saves, writer helpers that die with us, loads across EP layouts
    saves_torch_dist = bool(cfg.checkpoint.save) and cfg.checkpoint.ckpt_format == "torch_dist"
    kill_safe.keep_helpers_with_trainer(start_now=saves_torch_dist)
    note = kill_safe.prepare_resume(cfg)  # before any process group: a bad checkpoint is a one-line error
    if note and is_rank_zero():
        print(note, file=sys.stderr, flush=True)
    from bridge_ext import relayout

    note = relayout.prepare(cfg, world_size=world_size())
    if note:
        print(note, file=sys.stderr, flush=True)
    stop = kill_safe.graceful_stop()
    owns_group = prepared.use_cpu and not torch.distributed.is_initialized()
    if owns_group:
        from bridge_ext.cpu import init_cpu_distributed

        init_cpu_distributed()  # one process: in-memory store, no port; several: torchrun's rendezvous over gloo
    try:
        pretrain(cfg, forward_step, callbacks=[*prepared.callbacks, *callbacks, stop])
    except SystemExit as exc:  # Megatron Bridge ends a run stopped by its exit signal with sys.exit(0)
        if exc.code not in (0, None) or not stop.received:
            raise
    finally:
        stop.release()
        if owns_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return stop.received


def train(recipe: Recipe, cfg: Any, *, device: Device = "auto", data: Data = "auto") -> bool:
    """``nemo llm pretrain``'s run of a resolved config on this machine, with its console lines; in CPU mode
    the loss curve too (``losses.jsonl`` and ``loss.png`` next to the checkpoints). True when it stopped early
    on its exit signal (after saving)."""
    import signal

    prepared = prepare(recipe, cfg, device=device, data=data)
    say = print if is_rank_zero() else (lambda *a, **k: None)
    if prepared.use_cpu:
        say("CPU mode: no GPU visible (or --device cpu); a development and testing mode", file=sys.stderr)
    say(f"data: {prepared.data}", file=sys.stderr)
    from bridge_ext.kill_safe import stop_line

    if stop_line(cfg):
        say(stop_line(cfg), file=sys.stderr)
    callbacks = []
    if prepared.use_cpu:  # one process: record the loss curve next to the checkpoints
        run_dir = Path(cfg.checkpoint.save or f"nemo_experiments/{recipe.name}")
        losses = run_dir / "losses.jsonl"
        callbacks.append(loss_recorder(losses))
    stopped = run_pretrain(cfg, prepared, callbacks=callbacks)
    if stopped:
        from bridge_ext.checkpoints import read_tracker

        step = read_tracker(cfg.checkpoint.save)[0] if cfg.checkpoint.save else None
        say(f"stopped on {signal.Signals(cfg.train.exit_signal).name}"
            + (f" at iteration {step}, saved to {cfg.checkpoint.save}; run the same command to resume"
               if step is not None else " (nothing saved)"), file=sys.stderr)
    if prepared.use_cpu:
        curve = run_dir / "loss.png"
        if records_losses_here():  # one writer when several processes train
            write_loss_curve(losses, curve, title=f"{recipe.name}, {recipe.preset.name} preset")
        say(f"checkpoint:      {cfg.checkpoint.save or '(not saved: checkpoint.save is unset)'}")
        say(f"TensorBoard log: {cfg.logger.tensorboard_dir}")
        say(f"loss curve:      {curve} (values: {losses})")
    return stopped


def records_losses_here() -> bool:
    """Whether this process records the loss: the only one, or the last rank of several (see :func:`loss_recorder`)."""
    import torch

    dist = torch.distributed
    if dist.is_initialized():
        return dist.get_rank() == dist.get_world_size() - 1
    return is_last_rank()


def loss_recorder(path: Path, *, extra: dict[str, Any] | None = None):
    """A Megatron Bridge callback appending ``{"iteration", "loss", "grad_norm", "time"}`` JSON lines.

    Several processes: only the last rank writes (the last pipeline stage, where Megatron Bridge reports
    the loss averaged over the data-parallel ranks; ``train_utils.training_log`` prints on the same rank).
    """
    import time

    import torch
    from megatron.bridge.training.callbacks import Callback

    class LossRecorder(Callback):
        def __init__(self):
            self._sink = None
            if extra and records_losses_here():
                self.sink  # noqa: B018  (the settings line first, before any loss)

        @property
        def sink(self):
            if self._sink is None:
                path.parent.mkdir(parents=True, exist_ok=True)
                self._sink = path.open("a", buffering=1)
                if extra:
                    self._sink.write(json.dumps(extra) + "\n")
            return self._sink

        def on_train_step_end(self, context):
            if not records_losses_here():
                return
            loss = context.loss_dict.get("lm loss")
            value = float(loss.item() if torch.is_tensor(loss) else loss) if loss is not None else float("nan")
            grad_norm = float(context.grad_norm) if context.grad_norm is not None else None
            # fires before train.py increments train_state.step (megatron/bridge/training/train.py:445, 0.3.1)
            self.sink.write(json.dumps({"iteration": context.state.train_state.step + 1, "loss": value,
                                        "grad_norm": grad_norm, "time": time.time()}) + "\n")

        def on_train_end(self, context):
            if not records_losses_here():
                return
            self.sink.write(json.dumps({"done": True, "time": time.time()}) + "\n")
            self.sink.flush()

    return LossRecorder()


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON lines a :func:`loss_recorder` wrote so far (a line still being written is skipped)."""
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def read_losses(path: Path) -> dict[int, float]:
    """Iteration -> loss from a recorder's file (a resumed run's lines replace earlier ones)."""
    losses = {r["iteration"]: r["loss"] for r in read_records(path) if "loss" in r}
    return dict(sorted(losses.items()))


def write_loss_curve(losses_path: Path, png: Path, *, title: str) -> None:
    """Plot the training loss recorded in ``losses_path`` (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses = read_losses(losses_path)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(list(losses), list(losses.values()), linewidth=1.5)
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
