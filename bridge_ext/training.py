"""From a resolved config to Megatron Bridge's ``pretrain()``: the one path ``nemo llm pretrain``, ``finetune``
and ``compare`` share (device choice, data, stack fixes, CPU mode, preset run-time parts, callbacks).

Fine-tuning runs (:func:`run_finetune`): a recipe's config, a local JSONL and a pretrained checkpoint -> Megatron
Bridge. ``nemo llm finetune`` (``bridge_ext.commands.finetune``) and ``nemo llm compare``'s fine-tuning workers use
it: the pretrained checkpoint is checked against the recipe's model, the data is rendered with the tokenizer (the
proxies' shipped one; else the checkpoint's ``hf_source/``, where ``nemo llm import`` keeps the source's tokenizer
files) in the order of ``dataset.seed``, then the run. What fine-tuning is (data, instructions, the config's SFT /
LoRA parts, the LoRA merge) is ``bridge_ext.finetune``.

A Hugging Face checkpoint (``--hf DIR``) is imported on the fly (``bridge_ext.convert.import_hf``) into
``$MUON_RECIPES_CACHE/imports/<key>`` (:func:`import_target`), keyed by ``config.json`` and every safetensors
file's header and size (hashing the weights of a 1 T model would take an hour), in one process only: under
torchrun, run ``nemo llm import`` first and pass ``checkpoint.pretrained_checkpoint=DIR``.

The config arrives resolved (``bridge_ext.build.build_config``: every override applied, derived values set
once); nothing here changes a value for GPUs except the data.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from bridge_ext.errors import UserError
from bridge_ext.initialization import Init
from bridge_ext.runtime import is_last_rank, is_rank_zero, launcher_world_size, read_yaml, world_size

if TYPE_CHECKING:
    from collections.abc import Callable

    from recipes import Recipe

__all__ = ["CPU_PARAM_LIMIT", "Prepared", "Stop", "eval_recorder", "import_on_the_fly", "import_target",
           "loss_recorder", "prepare", "read_eval", "read_losses", "read_records", "records_losses_here",
           "run_finetune", "run_pretrain", "save_bytes", "train", "use_finetune_data", "write_loss_curve"]

Device = Literal["auto", "gpu", "cpu"]
Data = Literal["auto", "text", "mock"]
Stop = Literal["signal", "time limit", "exit interval"]  # why a run stopped early, after saving

CPU_PARAM_LIMIT = 2e9  # CPU mode is for proxies; anything bigger would take days or run out of memory


@dataclass
class Prepared:
    use_cpu: bool
    data: str  # one line for the console
    callbacks: list[Any] = field(default_factory=list)
    checksums: bool = True  # saves write an integrity record, a resume checks it (bridge_ext.checkpoints.integrity)
    init: Init = "by-name"  # the same weights at step 0 in every layout (bridge_ext.initialization); or "upstream"


def prepare(recipe: Recipe, cfg: Any, *, device: Device = "auto", data: Data = "auto", quiet: bool = False,
            telemetry: bool = True, checksums: bool = True, init: Init = "by-name") -> Prepared:
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
    if hasattr(cfg.dataset, "blend"):  # whatever the tokenizer: an empty split hangs megatron-core's dataset build
        from bridge_ext.corpus import check_real_data

        check_real_data(cfg)  # the tokenizer fits the model; the blend exists, its splits hold documents, and it
        # was made with this tokenizer
    if getattr(cfg.tokenizer, "tokenizer_type", None) == "HuggingFaceTokenizer" and hasattr(cfg.dataset, "blend"):
        from bridge_ext.tokenizers import use_megatron_tokenizer

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
            from bridge_ext.without_te import configure_without_te

            note = configure_without_te(cfg)
            patches.apply("without-te")  # MLA and MoE modules built without TE
            if not quiet and is_rank_zero():
                print(note, file=sys.stderr, flush=True)
    from bridge_ext.muon.attention_logits import QKClipTracking, use_kernel_max_logit
    from bridge_ext.muon import MuonTelemetry
    from bridge_ext.muon.presets import install_preset

    install_preset(recipe.preset, cfg)  # Newton-Schulz coefficients and the MuonClip fix (its config values: build.py)
    callbacks: list[Any] = []
    if telemetry and recipe.preset.kind == "muon":
        if not use_cpu:
            use_kernel_max_logit(cfg)  # TE measures the max logit in its kernel: no hook computes it
        callbacks.append(MuonTelemetry(interval=cfg.logger.log_interval))  # also keeps QK-clip's running max
    elif cfg.model.qk_clip:  # QK-clip needs the step's max over every micro-batch, telemetry or not
        callbacks.append(QKClipTracking())
    # the applied rows' pre-wrap hooks (e.g. tp-weight-attributes-without-init) first: init_by_name reads what they set
    patches.register_hooks(cfg.model)
    if init == "by-name":
        import functools

        from bridge_ext.initialization import init_by_name

        # Megatron Bridge's hook for changing the model before it is wrapped (ModelProviderMixin, 0.3 to 0.6)
        cfg.model.register_pre_wrap_hook(functools.partial(init_by_name, seed=cfg.rng.seed))
    return Prepared(use_cpu=use_cpu, data=description, callbacks=callbacks, checksums=checksums, init=init)


@functools.cache  # once per process
def _freeze_import_time_heap() -> None:
    """Once per process, before its first run: what is alive then (~680,000 objects after Megatron Bridge's
    imports: modules, classes, functions) moves to the collector's permanent generation (``gc.freeze``), so the
    full collections of a run -- Megatron Bridge's at the end of ``train()`` and under ``train.manual_gc`` (Kimi
    K2's and Moonlight's presets: every ``manual_gc_interval`` steps), ours after it -- walk only what runs
    made: 0.36 s each before, ~0 after (bench/gc_freeze.py: a Qwen3-MoE proxy run of 3 iterations, frozen /
    unfrozen 0.66 on an idle machine, 0.79 on a busy one). Garbage is collected first; what is frozen stays alive
    anyway (imports)."""
    import gc

    gc.collect()
    gc.freeze()


def run_pretrain(cfg: Any, prepared: Prepared, *, callbacks: list[Any] = ()) -> Stop | None:
    """Megatron Bridge's ``pretrain()`` with its GPT ``forward_step``, kill-safe (``bridge_ext.kill_safe``).

    Returns why the run stopped early after saving (``"signal"``: its exit signal, SIGTERM; ``"time limit"``:
    ``train.exit_duration_in_mins``; ``"exit interval"``: ``train.exit_interval``), None when it ran to its last
    iteration.
    """
    import gc

    import torch
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    from bridge_ext import kill_safe, patches

    _freeze_import_time_heap()
    patches.apply("checkpointing")  # atomic saves, writer helpers that die with us, loads across EP layouts
    saves_torch_dist = bool(cfg.checkpoint.save) and cfg.checkpoint.ckpt_format == "torch_dist"
    kill_safe.keep_helpers_with_trainer(start_now=saves_torch_dist)
    kill_safe.record_integrity(prepared.checksums)
    note = kill_safe.prepare_resume(cfg, checksums=prepared.checksums)  # before any process group: one line
    if note and is_rank_zero():
        print(note, file=sys.stderr, flush=True)
    from bridge_ext import relayout

    note = relayout.prepare(cfg, world_size=world_size())
    if note:
        print(note, file=sys.stderr, flush=True)
    from bridge_ext.checkpoints import writer_lock

    writer_lock.hold(cfg.checkpoint.save)  # after the checks that refuse a run: a refused run writes nothing
    stop = kill_safe.graceful_stop()
    owns_group = prepared.use_cpu and not torch.distributed.is_initialized()
    if owns_group:
        from bridge_ext.cpu import init_cpu_distributed

        init_cpu_distributed()  # one process: in-memory store, no port; several: torchrun's rendezvous over gloo
    stopped: Stop | None = None
    started = time.time()  # before Megatron Bridge's own start time: past its limit when it is
    try:
        pretrain(cfg, forward_step, callbacks=[*prepared.callbacks, *callbacks, stop])
    except SystemExit as exc:  # Megatron Bridge ends a run stopped early with sys.exit(0)
        limit = cfg.train.exit_duration_in_mins
        stopped = ("signal" if stop.received else "time limit" if limit and time.time() - started > 60 * limit
                   else "exit interval" if cfg.train.exit_interval else None)
        if exc.code not in (0, None) or stopped is None:
            _forget_the_failed_run()
            raise
    except BaseException:
        _forget_the_failed_run()
        raise
    finally:
        stop.release()
        # The run's reference cycles now, not at some later full collection: they hold its process groups,
        # whose gloo threads and sockets stay open until freed (a process that trains again piles them up).
        gc.collect()
        if owns_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return stopped


def _forget_the_failed_run() -> None:
    """A run that raised (a full disk, a bad batch) skipped Megatron Bridge's own clean-up: its process globals
    would refuse the next run in this process (the Python API, a notebook: "num microbatches calculator is already
    initialized")."""
    from bridge_ext.process_state import reset_megatron_globals

    reset_megatron_globals()


def save_bytes(recipe: Recipe, cfg: Any) -> int:
    """About the bytes of one save of ``recipe``'s run with ``cfg``: each parameter's weight (4 B in fp32, 2 B
    in bf16), its fp32 main copy (bf16 runs: 4 B) and its optimizer state (Muon's momentum 4 B for the
    matrices Muon takes, Adam's two moments 8 B for the rest); the routes from the recipe's Muon manifest
    (bridge_ext.muon.manifest: the shipped config's shapes)."""
    from bridge_ext.muon import muon_plan
    from recipes.optimizers import is_muon

    rows = muon_plan(recipe).rows
    total = sum(r.params for r in rows)
    muon = sum(r.params for r in rows if r.route == "muon") if is_muon(cfg.optimizer.optimizer) else 0
    bf16 = isinstance(cfg.mixed_precision, str) and cfg.mixed_precision.startswith("bf16")
    return total * (2 + 4 if bf16 else 4) + muon * 4 + (total - muon) * 8


def _warn_when_saves_do_not_fit(recipe: Recipe, cfg: Any, say: Callable[..., None]) -> None:
    """Before the first save: one line when fewer than two saves fit on checkpoint.save's filesystem (a LoRA
    run saves its adapters only: not estimated)."""
    if not cfg.checkpoint.save or "://" in str(cfg.checkpoint.save) or getattr(recipe, "mode", None) == "lora" \
            or not is_rank_zero():
        return
    from bridge_ext.checkpoints.disk_space import space_note

    note = space_note(cfg.checkpoint.save, save_bytes(recipe, cfg))
    if note:
        say(note, file=sys.stderr)


def train(recipe: Recipe, cfg: Any, *, device: Device = "auto", data: Data = "auto", checksums: bool = True,
          init: Init = "by-name") -> Stop | None:
    """``nemo llm pretrain``'s run of a resolved config on this machine, with its console lines; in CPU mode
    the loss curve too (``losses.jsonl`` and ``loss.png`` next to the checkpoints). Why it stopped early, after
    saving (the same command resumes it; :func:`run_pretrain`), or None."""
    from bridge_ext.checkpoints.writer_lock import run_scope

    with run_scope():  # the checkpoint directory's lock (taken in run_pretrain) lasts until the curve is written
        return _train(recipe, cfg, device=device, data=data, checksums=checksums, init=init)


def _train(recipe: Recipe, cfg: Any, *, device: Device, data: Data, checksums: bool, init: Init) -> Stop | None:
    import signal

    prepared = prepare(recipe, cfg, device=device, data=data, checksums=checksums, init=init)
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
    _warn_when_saves_do_not_fit(recipe, cfg, say)
    stopped = run_pretrain(cfg, prepared, callbacks=callbacks)
    if stopped:
        from bridge_ext.checkpoints import read_tracker

        step = read_tracker(cfg.checkpoint.save)[0] if cfg.checkpoint.save else None
        why = {"signal": f"on {signal.Signals(cfg.train.exit_signal).name}",
               "time limit": f"at its time limit (train.exit_duration_in_mins={cfg.train.exit_duration_in_mins})",
               "exit interval": f"at its exit interval (train.exit_interval={cfg.train.exit_interval})"}[stopped]
        say(f"stopped {why}"
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
    """Plot the training loss recorded in ``losses_path`` (``bridge_ext.plots``)."""
    from bridge_ext.plots import loss_figure

    losses = read_losses(losses_path)
    with loss_figure(png, title=title) as (ax,):
        ax.plot(list(losses), list(losses.values()), linewidth=1.5)
        ax.set_xlabel("iteration")
        ax.set_ylabel("training loss")


# ------------------------------------------------------------------------------------------- fine-tuning runs
# Architecture fields a pretrained checkpoint must share with the recipe's model (run_config.yaml "model").
_ARCH_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                "num_moe_experts", "multi_latent_attention", "kv_channels")


def _check_architecture(recipe: Any, cfg: Any, ckpt: Path) -> Path:
    """The iteration a pretrained checkpoint loads from, refused when its model is not the recipe's."""
    from bridge_ext.checkpoints import find_iteration

    try:
        iter_dir, _ = find_iteration(ckpt)
    except UserError as exc:
        raise UserError(f"checkpoint.pretrained_checkpoint: {str(exc).removeprefix('--ckpt ')}") from None
    run_config = iter_dir / "run_config.yaml"
    if run_config.is_file():
        model = (read_yaml(run_config) or {}).get("model") or {}
        wrong = [f"{name} {model[name]} (recipe: {getattr(cfg.model, name)})" for name in _ARCH_FIELDS
                 if name in model and model[name] != getattr(cfg.model, name, model[name])]
        if wrong:
            raise UserError(f"checkpoint {ckpt} holds another model than {recipe.name}'s {recipe.model.display}: "
                            f"{', '.join(wrong)}; pass a checkpoint of that model or pick its recipe")
    return iter_dir


def _tokenizer_dir(recipe: Any, cfg: Any, ckpt: Path, iter_dir: Path) -> Path:
    if cfg.tokenizer.tokenizer_model and Path(str(cfg.tokenizer.tokenizer_model)).is_dir():
        return Path(str(cfg.tokenizer.tokenizer_model))
    for candidate in (ckpt / "hf_source", iter_dir / "tokenizer"):
        if (candidate / "tokenizer_config.json").is_file() or (candidate / "tokenizer.json").is_file():
            return candidate
    raise UserError(f"no tokenizer for {recipe.name}: {ckpt} has no hf_source/ tokenizer files; import the model "
                    "with `nemo llm import` (it keeps them) or set tokenizer.tokenizer_model=DIR")


def _import_key(hf: Path) -> str:
    from bridge_ext.convert import read_safetensors_header

    digest = hashlib.sha256((hf / "config.json").read_bytes())
    for file in sorted(hf.glob("*.safetensors")):
        header = read_safetensors_header(file)
        digest.update(f"{file.name}\0{file.stat().st_size}\0".encode())
        digest.update(json.dumps({k: [str(v.dtype), list(v.shape)] for k, v in sorted(header.items())}).encode())
    return digest.hexdigest()[:20]


def import_target(hf: Path) -> Path:
    """Where ``--hf DIR`` is imported to (checked first: the config names it before validation)."""
    from bridge_ext.cache import cache_root

    if not (hf / "config.json").is_file():
        raise UserError(f"--hf {hf} is not a Hugging Face model directory (no config.json)")
    if (launcher_world_size() or 1) > 1:
        raise UserError("--hf imports in one process; under torchrun run `nemo llm import --hf DIR --out CKPT` "
                        "first and pass checkpoint.pretrained_checkpoint=CKPT")
    return cache_root() / "imports" / _import_key(hf)


def import_on_the_fly(hf: Path, target: Path) -> Path:
    if (target / "latest_checkpointed_iteration.txt").is_file():
        print(f"--hf: using the import cached at {target}", file=sys.stderr)
        return target
    from bridge_ext.convert import import_hf

    target.parent.mkdir(parents=True, exist_ok=True)
    summary = import_hf(hf, target, console=lambda line: print(line, file=sys.stderr))
    print(summary.line(), file=sys.stderr)
    from bridge_ext.process_state import reset_megatron_globals

    reset_megatron_globals()  # the import's Megatron globals (rerun state machine, ...) must not reach the run
    return target


def _cache() -> Path:
    from bridge_ext.cache import cache_root

    return cache_root()


def use_finetune_data(recipe: Any, cfg: Any, data: str | Path) -> tuple[Path, Any, Path]:
    """Check the pretrained checkpoint, render ``data`` with its tokenizer in the order of ``dataset.seed`` and
    point ``cfg`` at it. Returns ``(data file, SFTData, tokenizer directory)``.

    ``data``: a JSONL path or the name of a shipped set (``stdlib-signatures``)."""
    from bridge_ext.finetune.data import prepare_sft_data
    from bridge_ext.finetune.instructions import BUILTIN_SETS

    pretrained = cfg.checkpoint.pretrained_checkpoint
    ckpt = Path(str(pretrained)) if pretrained else None
    iter_dir = _check_architecture(recipe, cfg, ckpt) if ckpt else None
    tokenizer = _tokenizer_dir(recipe, cfg, ckpt or Path(str(cfg.checkpoint.load)), iter_dir or Path("."))
    data = BUILTIN_SETS[str(data)](_cache()) if str(data) in BUILTIN_SETS else Path(data)
    prepared_data = prepare_sft_data(data, tokenizer, cache=_cache(), seed=cfg.dataset.seed)
    cfg.dataset.dataset_root = str(prepared_data.root)
    cfg.tokenizer.tokenizer_model = str(tokenizer)
    return data, prepared_data, tokenizer


def run_finetune(recipe: Any, cfg: Any, *, data: str | Path, device: str = "auto", callbacks: list[Any] = (),
                 quiet: bool = False, record_dir: Path | None = None, loss_extra: dict[str, Any] | None = None,
                 telemetry: bool = True, checksums: bool = True, init: Init = "by-name") -> Path:
    """Check the checkpoint, render the data, then Megatron Bridge's fine-tuning run. Returns the run's directory.

    ``data``: a JSONL path or the name of a shipped set (``stdlib-signatures``). On CPU the training and
    held-out losses go to ``losses.jsonl`` / ``eval.jsonl`` in ``record_dir`` (default: the run directory;
    ``loss_extra`` is the first line of ``losses.jsonl``, as ``nemo llm compare`` writes it)."""
    from bridge_ext.checkpoints.writer_lock import run_scope

    with run_scope():  # the checkpoint directory's lock (taken in run_pretrain) lasts until the merge is written
        return _run_finetune(recipe, cfg, data=data, device=device, callbacks=callbacks, quiet=quiet,
                             record_dir=record_dir, loss_extra=loss_extra, telemetry=telemetry, checksums=checksums,
                             init=init)


def _run_finetune(recipe: Any, cfg: Any, *, data: str | Path, device: str, callbacks: list[Any], quiet: bool,
                  record_dir: Path | None, loss_extra: dict[str, Any] | None, telemetry: bool, checksums: bool,
                  init: Init) -> Path:
    say = print if is_rank_zero() and not quiet else (lambda *a, **k: None)
    data, prepared_data, tokenizer = use_finetune_data(recipe, cfg, data)
    say(f"data: {data}: {prepared_data.train} training and {prepared_data.validation} held-out records, rendered "
        f"with {tokenizer}'s chat template, training order of seed {cfg.dataset.seed} ({prepared_data.root})",
        file=sys.stderr)
    prepared = prepare(recipe, cfg, device=device, quiet=quiet, telemetry=telemetry, checksums=checksums, init=init)
    if prepared.use_cpu:
        say("CPU mode: no GPU visible (or --device cpu); a development and testing mode", file=sys.stderr)
    run_dir = Path(cfg.checkpoint.save or f"nemo_experiments/{recipe.name}")
    records = Path(record_dir) if record_dir is not None else run_dir
    recorders = []
    if prepared.use_cpu or record_dir is not None:
        recorders = [loss_recorder(records / "losses.jsonl", extra=loss_extra),
                     eval_recorder(records / "eval.jsonl")]
    # megatron.bridge.training.finetune.finetune() is this check followed by pretrain(config, forward_step); it
    # takes no callbacks, so the same check is made here and pretrain() runs with them (run_pretrain).
    if cfg.checkpoint.pretrained_checkpoint is None and cfg.checkpoint.load is None:
        raise UserError("fine-tuning needs checkpoint.pretrained_checkpoint or checkpoint.load")
    if recipe.mode == "lora" and recipe.preset.kind == "muon":
        from bridge_ext.finetune.lora import muon_without_adam_part

        muon_without_adam_part()
    # The merge reads one process's full model: with several processes (shards) it would write a partial one.
    merge_lora = recipe.mode == "lora" and prepared.use_cpu and cfg.checkpoint.save and \
        (launcher_world_size() or 1) == 1
    if merge_lora:
        from bridge_ext.finetune.lora import MERGED_DIR, merged_lora_saver

        recorders.append(merged_lora_saver(Path(cfg.checkpoint.save) / MERGED_DIR, tokenizer_dir=tokenizer))
    _warn_when_saves_do_not_fit(recipe, cfg, say)
    run_pretrain(cfg, prepared, callbacks=[*recorders, *callbacks])
    if prepared.use_cpu:
        evals = read_eval(records / "eval.jsonl")
        if evals:
            first, last = next(iter(evals.items())), list(evals.items())[-1]
            say(f"eval loss (held-out): {first[1]:.4f} at iteration {first[0]} -> {last[1]:.4f} at {last[0]}")
        say(f"checkpoint:      {cfg.checkpoint.save or '(not saved: checkpoint.save is unset)'}")
        if merge_lora:
            say(f"merged LoRA:     {Path(cfg.checkpoint.save) / 'merged'} (`nemo llm export --ckpt` it)")
        elif recipe.mode == "lora" and cfg.checkpoint.save:
            say("merged LoRA:     not written (the merge reads one process's whole model; this run had several)")
    return run_dir


def eval_recorder(path: Path):
    """A callback appending ``{"iteration", "eval_loss"}`` lines after each validation pass."""
    import torch
    from megatron.bridge.training.callbacks import Callback

    class EvalRecorder(Callback):
        def __init__(self):
            path.parent.mkdir(parents=True, exist_ok=True)
            self.sink = path.open("a", buffering=1)

        def on_eval_end(self, context):
            loss = (context.total_loss_dict or {}).get("lm loss")
            if loss is None:
                return
            value = float(loss.item() if torch.is_tensor(loss) else loss)
            self.sink.write(json.dumps({"iteration": context.state.train_state.step, "eval_loss": value}) + "\n")

    return EvalRecorder()


def read_eval(path: Path) -> dict[int, float]:
    """Iteration -> held-out loss from an :func:`eval_recorder` file (the last value per iteration)."""
    return {r["iteration"]: r["eval_loss"] for r in read_records(path) if "eval_loss" in r}
