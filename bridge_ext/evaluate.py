"""``nemo llm evaluate``: held-out loss and perplexity of saved checkpoints, by Megatron Bridge's own evaluation.

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
for another amount, and the data when ``--data`` names other data.

Before anything loads: :func:`bridge_ext.checkpoints.find_iteration` (pickles vetted) and
:func:`bridge_ext.checkpoints.integrity.verify` with ``scope="model"``, for every iteration.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bridge_ext.errors import UserError

__all__ = ["Evaluated", "evaluate_checkpoint", "run_evaluate", "select_iterations", "write_csv", "write_plot"]

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


def select_iterations(ckpt: Path, *, iteration: int | None, every: bool) -> list[tuple[Path, int]]:
    """The iterations to evaluate, each found (and vetted) by :func:`bridge_ext.checkpoints.find_iteration`."""
    from bridge_ext.checkpoints import find_iteration, is_complete, iterations

    if not every:
        return [find_iteration(ckpt, iteration)]
    if not ckpt.is_dir():
        find_iteration(ckpt)  # its one-line error
    complete = [n for n, path in iterations(ckpt).items() if is_complete(path)]
    if not complete:
        find_iteration(ckpt)  # not a checkpoint / nothing complete: its error
        raise UserError(f"--ckpt {ckpt} has no complete iteration")
    return [find_iteration(ckpt, n) for n in complete]


def _section(cfg: Any) -> Any:
    """Where eval_iters / skip_train live: ``validation`` (megatron-bridge >= 0.4) or ``train``."""
    return getattr(cfg, "validation", None) or cfg.train


def _use_data(cfg: Any, data: str | None) -> str:
    blend = getattr(cfg.dataset, "blend", None)
    if data is None:
        if getattr(cfg.dataset, "mock", False) or blend is None:
            return "mock data (as the run)"
        prefixes = blend[0] if blend else []
        missing = [p for p in prefixes if not Path(f"{p}.idx").is_file()]
        if missing:
            raise UserError(f"the run's data {missing[0]} is gone (no .idx); pass --data PATH or --data mock")
        return f"the run's data, validation split {cfg.dataset.split} ({', '.join(map(str, prefixes))})"
    if data == "mock":
        raise UserError("--data mock: not supported yet; the run's own data or a prepare-data prefix")
    path = Path(data)
    prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
    if not Path(f"{prefix}.idx").is_file() or not Path(f"{prefix}.bin").is_file():
        if path.suffix in (".jsonl", ".txt", ".json", ".yaml", ".yml"):
            raise UserError(f"--data {path}: only Megatron indexed datasets (prepare-data's PREFIX.bin/.idx) are "
                            "evaluated so far; run `nemo llm prepare-data` on it with the model's tokenizer first")
        raise UserError(f"--data {data}: no {prefix}.bin/.idx (a prefix from `nemo llm prepare-data`)")
    cfg.dataset.blend = [[str(prefix)], None]
    cfg.dataset.blend_per_split = None
    return f"{prefix}, validation split {cfg.dataset.split}"


def _config(ckpt: Path, iter_dir: Path, number: int, *, data: str | None, tokens: int | None) -> tuple[Any, str]:
    from megatron.bridge.training.config import ConfigContainer

    from bridge_ext.inference.model import read_run_config

    from bridge_ext.inference.model import without_runtime_objects

    cfg = ConfigContainer.from_dict(without_runtime_objects(read_run_config(iter_dir)))
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
    batch = cfg.train.global_batch_size * cfg.model.seq_length
    section = _section(cfg)
    runs = getattr(section, "eval_iters", None) or getattr(cfg.train, "eval_iters", None) or 0
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
    described = _use_data(cfg, data)
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


def _run(ckpt: Path, iter_dir: Path, number: int, *, data: str | None, tokens: int | None) -> tuple[Any, str, Any]:
    import gc

    import torch

    from bridge_ext import patches

    patches.apply("stack")
    cpu = not torch.cuda.is_available()
    if cpu:
        from bridge_ext import cpu as cpu_mode

        cpu_mode.enable_cpu_mode()
    cfg, described = _config(ckpt, iter_dir, number, data=data, tokens=tokens)
    if cpu:
        from bridge_ext.cpu import configure_for_cpu

        configure_for_cpu(cfg)
        cfg.dataset.num_workers = 0
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


def evaluate_checkpoint(ckpt: Path, iter_dir: Path, number: int, *, data: str | None = None,
                        tokens: int | None = None, checksums: bool = True, verbose: bool = False) -> Evaluated:
    """One iteration's held-out loss (see the module's docstring)."""
    from bridge_ext.checkpoints.integrity import verify

    verify(iter_dir, scope="model", checksums=checksums)
    from bridge_ext.convert.report import quiet_upstream
    from bridge_ext.inference.model import quiet_native_output

    with quiet_upstream(verbose=verbose), quiet_native_output(not verbose):
        cfg, described, capture = _run(ckpt, iter_dir, number, data=data, tokens=tokens)
    if capture.loss is None:
        raise UserError(f"Megatron Bridge's evaluation of {iter_dir} returned no loss (no validation data?)")
    batch = cfg.train.global_batch_size * cfg.model.seq_length
    return Evaluated(str(ckpt), number, number * batch, _section(cfg).eval_iters * batch, capture.loss,
                     math.exp(min(capture.loss, 700.0)), described)


def write_csv(rows: list[Evaluated], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        for row in rows:
            writer.writerow(asdict(row))


def write_plot(rows: list[Evaluated], path: Path) -> None:
    """Held-out loss against iteration and against training tokens, one line per run (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_iter, by_tokens) = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
    for run in dict.fromkeys(r.run for r in rows):
        mine = sorted((r for r in rows if r.run == run), key=lambda r: r.iteration)
        label = Path(run).name if Path(run).name not in ("checkpoints", "") else str(Path(run).parent.name)
        by_iter.plot([r.iteration for r in mine], [r.loss for r in mine], marker="o", label=label)
        by_tokens.plot([r.train_tokens for r in mine], [r.loss for r in mine], marker="o", label=label)
    for ax, xlabel in ((by_iter, "iteration"), (by_tokens, "training tokens")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("nemo llm evaluate: held-out loss", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _table(rows: list[Evaluated]) -> str:
    width = max(len("run"), *(len(r.run) for r in rows))
    lines = [f"{'run':<{width}}  {'iteration':>9}  {'train tokens':>12}  {'eval tokens':>11}  {'loss':>8}  "
             f"{'perplexity':>10}"]
    for r in rows:
        lines.append(f"{r.run:<{width}}  {r.iteration:>9}  {r.train_tokens:>12,}  {r.eval_tokens:>11,}  "
                     f"{r.loss:>8.4f}  {r.perplexity:>10.3f}")
    return "\n".join(lines)


def run_evaluate(*, ckpts: list[Path], iteration: int | None = None, every: bool = False, data: str | None = None,
                 tokens: int | None = None, out: Path | None = None, as_json: bool = False, checksums: bool = True,
                 verbose: bool = False) -> list[Evaluated]:
    """The command: every selected iteration of every ``--ckpt``; a table (or JSON lines); CSV + PNG in ``out``."""
    if out is not None and out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is not a directory")
    plan = [(ckpt, iter_dir, number) for ckpt in ckpts
            for iter_dir, number in select_iterations(ckpt, iteration=iteration, every=every)]  # all checked first
    rows = []
    for ckpt, iter_dir, number in plan:
        print(f"evaluating {ckpt} iteration {number} ...", file=sys.stderr, flush=True)
        row = evaluate_checkpoint(ckpt, iter_dir, number, data=data, tokens=tokens, checksums=checksums,
                                  verbose=verbose)
        rows.append(row)
        if as_json:
            print(json.dumps(asdict(row)), flush=True)
    if not as_json:
        print(f"data: {rows[0].data}")
        print(_table(rows))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_csv(rows, out / "evaluate.csv")
        write_plot(rows, out / "evaluate.png")
        print(f"wrote {out / 'evaluate.csv'} and {out / 'evaluate.png'}", file=sys.stderr)
    return rows
