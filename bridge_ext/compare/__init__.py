"""``nemo llm compare``: train two or more recipes on the same data, seed and token budget; compare the losses.

Each run is Megatron Bridge's real ``pretrain()`` with ``gpt_step.forward_step`` in its own subprocess
(``python -m bridge_ext.compare --worker SPEC``), so Megatron's process-global state never leaks from one
run into the next; CPU mode (:mod:`bridge_ext.cpu`) is used when no GPU is visible. The training
loss of every iteration is recorded by a Megatron Bridge callback (``on_train_step_end``, the averaged
``lm loss`` of the global batch) and streamed to ``runs/<run>/losses.jsonl``; nothing is scraped from logs.

Outputs in ``--out``: ``loss.csv`` (iteration, one column per run), ``loss.png`` (the curves),
``summary.json`` and ``runs/<run>/{spec.json,losses.jsonl,train.log}``. The console gets, per run, the
final loss and the number of iterations it needed to reach the best (smoothed) loss that the slowest run
reached.

A recipe may carry its own overrides: ``--recipes qwen3_proxy_muon:optimizer.lr=1e-2,qwen3_proxy_adamw``.
``--sweep KEY=V1,V2,...`` runs every recipe once per value (several ``--sweep`` options are zipped): how
the proxies' default learning rates were tuned (docs/cpu.md). The recipes may also be named before the
overrides: ``nemo llm compare qwen3_proxy_muon qwen3_proxy_adamw --out DIR``.

Fine-tuning recipes (``recipes.finetune``: ``<model>_sft_*``, ``<model>_lora_*``) compare the same way, from
one pretrained checkpoint (``checkpoint.pretrained_checkpoint=DIR``, applied to every run) on one instruction
set (``--data FILE.jsonl`` or ``stdlib-signatures``, the default): each worker runs ``nemo llm finetune``'s own
path (``bridge_ext.training.run_finetune``), the training records in the order of ``--seed``
(``dataset.seed``), the same for every run. Besides the training loss, each run's loss on the held-out split
(``eval.jsonl``, Megatron Bridge's validation ``lm loss`` at every ``train.eval_interval`` and after the last
iteration; also in the run's TensorBoard log ``runs/<run>/tb``) is compared: ``eval.csv`` and the console's
held-out table.

Modules: ``runs`` (the runs from ``--recipes`` / ``--sweep``), ``checks`` (``--out``, ``--data``, checkpoints,
before anything trains), ``config`` (one run's ``ConfigContainer``), ``worker`` (the subprocess, both sides),
``metrics`` (smoothing, iterations to a loss), ``output`` (CSV, plot, tables), ``run`` (:func:`run_compare`).
"""

from bridge_ext.compare.metrics import iterations_to_reach, smooth, summarize
from bridge_ext.compare.output import format_evals, format_summary, write_csv, write_eval_csv, write_plot
from bridge_ext.compare.run import run_compare
from bridge_ext.compare.runs import DEFAULT_ITERS, DEFAULT_SEED, DEFAULT_SMOOTH, Run, RunResult, is_finetune, parse_runs
from bridge_ext.compare.worker import main, train_one

__all__ = ["DEFAULT_ITERS", "DEFAULT_SEED", "DEFAULT_SMOOTH", "Run", "RunResult", "format_evals", "format_summary",
           "is_finetune", "iterations_to_reach", "main", "parse_runs", "run_compare", "smooth", "summarize", "train_one",
           "write_csv", "write_eval_csv", "write_plot"]
