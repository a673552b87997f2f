"""Held-out loss and perplexity of a saved iteration, by Megatron Bridge's own evaluation.

For each evaluated iteration the run's own ``iter_N/run_config.yaml`` becomes the config again
(``ConfigContainer.from_yaml``) and Megatron Bridge's ``pretrain()`` runs it with ``skip_train`` (train.skip_train
on megatron-bridge 0.3, validation.skip_train from 0.4): its ``setup()`` builds the model the run trained, loads
iteration N's weights (``checkpoint.ckpt_step``; no optimizer state, no RNG state) and builds the validation data
loader from the start of the validation split; then ``megatron.bridge.training.eval.evaluate_and_print_results``
computes the loss the training loop prints as "validation loss at iteration N" (``lm loss``: the token-weighted
mean cross-entropy over ``eval_iters`` global batches). Perplexity is ``exp(loss)``.

What changes from the saved config, and why it does not change the number: the process layout (this machine: one
process, CPU mode without a GPU, as ``nemo llm pretrain`` does for proxies), the optimizer (AdamW: never stepped;
the run's Muon is not built for nothing), no saving, no TensorBoard/W&B, ``eval_iters`` when ``--tokens`` asks
for another amount, and the data when ``--data`` names other data (:func:`bridge_ext.evaluate.data.use_data`). A
checkpoint without a run (``nemo llm import``) is evaluated in Megatron Bridge's pre-training template around its
model.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bridge_ext.errors import UserError
from bridge_ext.evaluate.data import use_data
from bridge_ext.evaluate.iterations import select_iterations
from recipes.budget import tokens_per_step

__all__ = ["Evaluated", "evaluate_checkpoint", "run_evaluate", "write_csv", "write_plot"]

DEFAULT_EVAL_ITERS = 16  # when the run validated on nothing (the proxies' default eval_iters is 0)


@dataclass
class Evaluated:
    run: str  # the checkpoint root as given
    iteration: int
    train_tokens: int  # tokens the run had trained on at this iteration (iteration x global batch x sequence)
    eval_tokens: int  # held-out tokens in the evaluation (eval_iters x global batch x sequence)
    loss: float  # Megatron Bridge's validation "lm loss"
    perplexity: float
    data: str


def _section(cfg: Any) -> Any:
    """Where eval_iters / skip_train live: ``validation`` (megatron-bridge >= 0.4) or ``train``."""
    return getattr(cfg, "validation", None) or cfg.train


def _from_template(run_config: dict[str, Any]) -> Any:
    """A ConfigContainer for a checkpoint whose run config has a model but no run (``nemo llm import`` writes
    only the model, tokenizer and checkpoint sections): Megatron Bridge's pre-training template
    (:func:`bridge_ext.patches.adapters.pretrain_template`) with the checkpoint's model; one sequence per batch."""
    from bridge_ext.inference.model import model_provider
    from bridge_ext.upstream_api import pretrain_template

    cfg = pretrain_template()
    cfg.model = model_provider(run_config)
    seq = int(cfg.model.seq_length)
    cfg.train.micro_batch_size = cfg.train.global_batch_size = 1
    cfg.train.train_iters = 1
    cfg.dataset.seq_length = seq
    if hasattr(cfg.dataset, "sequence_length"):
        cfg.dataset.sequence_length = seq
    cfg.dataset.blend = cfg.dataset.blend_per_split = None
    cfg.mixed_precision = None  # the model's own dtype (the import's run config records it)
    cfg.tokenizer.tokenizer_type = "HuggingFaceTokenizer"  # the checkpoint's own (set by the caller)
    cfg.tokenizer.vocab_size = None
    if hasattr(cfg.tokenizer, "use_tokenizer_vocab_size"):
        cfg.tokenizer.use_tokenizer_vocab_size = False
    for holder in (cfg.ddp, cfg.optimizer):
        if hasattr(holder, "use_distributed_optimizer"):
            holder.use_distributed_optimizer = False
    return cfg


def _is_import(run_config: dict[str, Any]) -> bool:
    """A run config with a model but no run (``nemo llm import``)."""
    return not isinstance(run_config.get("train"), dict) or not isinstance(run_config.get("dataset"), dict)


def _no_data(iter_dir: Path) -> UserError:
    return UserError(f"{iter_dir} holds a model without a training run (an import): no data of its own; "
                     "pass --data PATH (a .jsonl/.txt file, a prepare-data prefix or YAML) or --data mock")


def _config(ckpt: Path, iter_dir: Path, number: int, *, data: str | None, tokens: int | None,
            split: str | None = None, tp: int | None = None) -> tuple[Any, str]:
    from megatron.bridge.training.config import ConfigContainer

    from bridge_ext.inference.model import read_run_config, without_runtime_objects

    run_config = read_run_config(iter_dir)
    imported = _is_import(run_config)
    if imported:
        if data is None:
            raise _no_data(iter_dir)
        from bridge_ext.inference.model import checkpoint_tokenizer

        cfg = _from_template(run_config)
        # the import's tokenizer: also the mock dataset's end of document, an id of the model's vocabulary
        cfg.tokenizer.tokenizer_model = str(checkpoint_tokenizer(ckpt, iter_dir, run_config).directory)
    else:
        cfg = ConfigContainer.from_dict(without_runtime_objects(run_config))
    if tp is not None:  # the checkpoint is resharded on load (torch_dist)
        cfg.model.tensor_model_parallel_size = tp
        if hasattr(cfg.model, "expert_tensor_parallel_size"):
            cfg.model.expert_tensor_parallel_size = tp
        if tp == 1:
            cfg.model.sequence_parallel = False
    root = iter_dir.parent
    c = cfg.checkpoint
    c.load, c.ckpt_step, c.load_optim, c.load_rng, c.finetune = str(root), number, False, False, False
    c.pretrained_checkpoint, c.save, c.async_save = None, None, False
    logger = cfg.logger
    logger.tensorboard_dir = None
    for name in ("wandb_project", "wandb_exp_name"):
        if hasattr(logger, name):
            setattr(logger, name, None)
    opt = cfg.optimizer
    if opt.optimizer not in ("adam", "sgd"):  # never stepped: the run's Muon is not built for nothing
        opt.optimizer = "adam"
        opt.use_distributed_optimizer = False
    batch = tokens_per_step(cfg.train.global_batch_size, cfg.model.seq_length)
    section = _section(cfg)
    runs = getattr(section, "eval_iters", None) or getattr(cfg.train, "eval_iters", None) or 0
    if imported:
        runs = 0
    eval_iters = math.ceil(tokens / batch) if tokens else (runs or DEFAULT_EVAL_ITERS)
    for holder in {id(section): section, id(cfg.train): cfg.train}.values():
        if hasattr(holder, "eval_iters"):
            holder.eval_iters = eval_iters
        if hasattr(holder, "skip_train"):
            holder.skip_train = True
    # With skip_train, Megatron Bridge builds the validation loader with dataset.dataloader_type from sample 0; a
    # training run's is always "cyclic" for GPT datasets (megatron/bridge/data/loaders.py): the same batches as the
    # run's first validation pass need the same sampler.
    if type(cfg.dataset).__name__ in ("GPTDatasetConfig", "MockGPTDatasetConfig"):
        cfg.dataset.dataloader_type = "cyclic"
    described = use_data(cfg, data, split=split, ckpt=ckpt, iter_dir=iter_dir, run_config=run_config)
    return cfg, described


class _Capture:
    """Megatron Bridge callback keeping the validation pass's ``lm loss`` (the test pass is not kept)."""

    def __new__(cls):
        from megatron.bridge.training.callbacks import Callback

        class Capture(Callback):
            loss: float | None = None

            def on_eval_end(self, context):
                import torch

                value = (context.total_loss_dict or {}).get("lm loss")
                if value is not None and self.loss is None:
                    self.loss = float(value.item() if torch.is_tensor(value) else value)

        return Capture()


def _fit_batch(cfg: Any, world: int) -> None:
    """The global batch split over this launch's data-parallel ranks: the micro batch shrinks to the global batch /
    data-parallel size when the run's does not divide it (the loss is a token-weighted mean over the same global
    batches either way)."""
    m = cfg.model
    model_parallel = (m.tensor_model_parallel_size or 1) * (m.pipeline_model_parallel_size or 1) * (
        m.context_parallel_size or 1)
    dp = max(world // model_parallel, 1)
    train = cfg.train
    if train.global_batch_size % (train.micro_batch_size * dp):
        if train.global_batch_size % dp:
            raise UserError(f"the run's global batch of {train.global_batch_size} does not split over {dp} "
                            "data-parallel ranks; launch a number of processes that divides it")
        train.micro_batch_size = train.global_batch_size // dp


def _run(ckpt: Path, iter_dir: Path, number: int, *, data: str | None, tokens: int | None,
         split: str | None, tp: int | None = None) -> tuple[Any, str, Any]:
    import gc

    import torch

    from bridge_ext import patches

    patches.apply("stack")
    cpu = not torch.cuda.is_available()
    if cpu:
        from bridge_ext import cpu as cpu_mode

        cpu_mode.enable_cpu_mode()
    cfg, described = _config(ckpt, iter_dir, number, data=data, tokens=tokens, split=split, tp=tp)
    from bridge_ext.runtime import world_size

    if cpu:
        from bridge_ext.cpu import configure_for_cpu

        configure_for_cpu(cfg)  # keeps the parallel sizes this launch holds; one process: every size 1
        cfg.dataset.num_workers = 0
    _fit_batch(cfg, world_size())
    if getattr(cfg.tokenizer, "tokenizer_type", None) == "HuggingFaceTokenizer":
        from bridge_ext.tokenizers import use_megatron_tokenizer

        use_megatron_tokenizer(cfg)  # a Kimi K2 tiktoken directory: converted once, no remote code
    patches.apply("checkpointing")
    capture = _Capture()
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    owns_group = cpu and not torch.distributed.is_initialized()
    if owns_group:
        from bridge_ext.cpu import init_cpu_distributed

        init_cpu_distributed()
    try:
        pretrain(cfg, forward_step, callbacks=[capture])
    finally:
        gc.collect()
        if owns_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return cfg, described, capture


@contextlib.contextmanager
def _process_group() -> Iterator[None]:
    """Several CPU processes (torchrun, no GPU): CPU mode and one gloo group for every evaluated iteration (each
    ``pretrain()`` makes and ends its own groups inside it); otherwise nothing (one process: :func:`_run` makes
    an in-memory group per iteration; GPUs: Megatron Bridge's initialization)."""
    import torch

    from bridge_ext.runtime import world_size

    if world_size() == 1 or torch.cuda.is_available() or torch.distributed.is_initialized():
        yield
        return
    from bridge_ext import cpu as cpu_mode
    from bridge_ext.inference.model import quiet_native_output

    cpu_mode.enable_cpu_mode()
    with quiet_native_output(True):  # gloo's "[Gloo] Rank R is connected ..."
        cpu_mode.init_cpu_distributed()
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def evaluate_checkpoint(ckpt: Path, iter_dir: Path, number: int, *, data: str | None = None,
                        tokens: int | None = None, split: str | None = None, checksums: bool = True,
                        verbose: bool = False, tp: int | None = None) -> Evaluated:
    """One iteration's held-out loss (see the module's docstring)."""
    from bridge_ext.checkpoints.integrity import verify

    verify(iter_dir, scope="model", checksums=checksums)
    from bridge_ext.convert.report import quiet_upstream
    from bridge_ext.inference.model import quiet_native_output

    with quiet_upstream(verbose=verbose), quiet_native_output(not verbose):
        cfg, described, capture = _run(ckpt, iter_dir, number, data=data, tokens=tokens, split=split, tp=tp)
    if capture.loss is None:
        raise UserError(f"Megatron Bridge's evaluation of {iter_dir} returned no loss (no validation data?)")
    batch = tokens_per_step(cfg.train.global_batch_size, cfg.model.seq_length)
    return Evaluated(str(ckpt), number, number * batch, _section(cfg).eval_iters * batch, capture.loss,
                     math.exp(min(capture.loss, 700.0)), described)


def write_csv(rows: list[Evaluated], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        for row in rows:
            writer.writerow(asdict(row))


def write_plot(rows: list[Evaluated], path: Path) -> None:
    """Held-out loss against iteration and against training tokens, one line per run (``bridge_ext.plots``)."""
    from bridge_ext.plots import loss_figure

    with loss_figure(path, title="nemo llm evaluate: held-out loss", panels=2, size=(11, 4)) as (by_iter, by_tokens):
        for run in dict.fromkeys(r.run for r in rows):
            mine = sorted((r for r in rows if r.run == run), key=lambda r: r.iteration)
            label = Path(run).name if Path(run).name not in ("checkpoints", "") else str(Path(run).parent.name)
            by_iter.plot([r.iteration for r in mine], [r.loss for r in mine], marker="o", label=label)
            by_tokens.plot([r.train_tokens for r in mine], [r.loss for r in mine], marker="o", label=label)
        for ax, xlabel in ((by_iter, "iteration"), (by_tokens, "training tokens")):
            ax.set_xlabel(xlabel)
            ax.set_ylabel("held-out loss")
            ax.legend(fontsize=8)


def _table(rows: list[Evaluated]) -> str:
    width = max(len("run"), *(len(r.run) for r in rows))
    lines = [f"{'run':<{width}}  {'iteration':>9}  {'train tokens':>12}  {'eval tokens':>11}  {'loss':>8}  "
             f"{'perplexity':>10}"]
    for r in rows:
        lines.append(f"{r.run:<{width}}  {r.iteration:>9}  {r.train_tokens:>12,}  {r.eval_tokens:>11,}  "
                     f"{r.loss:>8.4f}  {r.perplexity:>10.3f}")
    return "\n".join(lines)


def run_evaluate(*, ckpts: list[Path], iteration: int | None = None, every: bool = False, data: str | None = None,
                 tokens: int | None = None, split: str | None = None, out: Path | None = None,
                 as_json: bool = False, checksums: bool = True, verbose: bool = False,
                 tp: int | None = None) -> list[Evaluated]:
    """The command: every selected iteration of every ``--ckpt``; a table (or JSON lines); CSV + PNG in ``out``.

    Under torchrun every process runs this; Megatron Bridge's evaluation splits the work (``tp``: tensor parallel
    size, else the run's where the launch holds it; the other processes: data-parallel ranks) and rank 0 prints
    and writes. On CPU one gloo group serves every evaluated iteration."""
    from bridge_ext.runtime import is_rank_zero, world_size

    if out is not None and out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is not a directory")
    if tp is not None and world_size() % tp:
        raise UserError(f"--tp {tp} needs a multiple of {tp} processes; this launch has {world_size()} "
                        f"(torchrun --nproc-per-node {tp})")
    plan = [(ckpt, iter_dir, number) for ckpt in ckpts
            for iter_dir, number in select_iterations(ckpt, iteration=iteration, every=every)]  # all checked first
    if data is None:
        from bridge_ext.inference.model import read_run_config

        for _, iter_dir, _ in plan:
            if _is_import(read_run_config(iter_dir)):
                raise _no_data(iter_dir)
    with _process_group():
        rows = []
        for ckpt, iter_dir, number in plan:
            if is_rank_zero():
                print(f"evaluating {ckpt} iteration {number} ...", file=sys.stderr, flush=True)
            row = evaluate_checkpoint(ckpt, iter_dir, number, data=data, tokens=tokens, split=split,
                                      checksums=checksums, verbose=verbose, tp=tp)
            rows.append(row)
            if as_json and is_rank_zero():
                print(json.dumps(asdict(row)), flush=True)
    if not is_rank_zero():
        return rows
    if not as_json:
        print(f"data: {rows[0].data}")
        print(_table(rows))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_csv(rows, out / "evaluate.csv")
        write_plot(rows, out / "evaluate.png")
        print(f"wrote {out / 'evaluate.csv'} and {out / 'evaluate.png'}", file=sys.stderr)
    return rows
