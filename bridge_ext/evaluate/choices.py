"""``nemo llm evaluate --choices``: multiple-choice accuracy (acc, acc_norm) as lm-evaluation-harness scores it,
through the checkpoint's own forward (:mod:`bridge_ext.inference.model`), not Megatron Bridge's evaluation loop."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bridge_ext.errors import UserError
from bridge_ext.evaluate.iterations import select_iterations

__all__ = ["ChoiceRecord", "Scored", "encode_pair", "read_choices", "run_choices", "score_choices"]


@dataclass(frozen=True)
class ChoiceRecord:
    line: int
    context: str
    choices: list[str]
    label: int


@dataclass
class Scored:
    line: int
    label: int
    loglikelihoods: list[float]  # per choice: the sum of its tokens' log-probabilities given the context
    tokens: list[int]  # per choice: how many tokens were scored
    bytes: list[int]  # per choice: its UTF-8 length (acc_norm's divisor)
    pred: int  # argmax of loglikelihoods (first on ties, as numpy.argmax)
    pred_norm: int  # argmax of loglikelihoods / bytes


def read_choices(path: Path) -> list[ChoiceRecord]:
    """``{"context": str, "choices": [str, ...], "label": int}`` per line (blank lines skipped); anything else is
    refused in one line naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--choices {path} does not exist")
    records = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise UserError(f"--choices {path} is not UTF-8 text") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise UserError(f"{where}: not a JSON object")
        missing = [k for k in ("context", "choices", "label") if k not in record]
        if missing:
            raise UserError(f"{where}: no {missing[0]!r} (each line needs context, choices and label)")
        context, choices, label = record["context"], record["choices"], record["label"]
        if not isinstance(context, str):
            raise UserError(f"{where}: context must be a string")
        if not isinstance(choices, list) or not choices:
            raise UserError(f"{where}: choices must be a non-empty list of strings")
        if not all(isinstance(c, str) and c for c in choices):
            raise UserError(f"{where}: every choice must be a non-empty string")
        if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(choices):
            raise UserError(f"{where}: label {label!r} is not an index into its {len(choices)} choices")
        records.append(ChoiceRecord(number, context, list(choices), label))
    if not records:
        raise UserError(f"--choices {path} has no records")
    return records


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-evaluation-harness's ``_encode_pair``: trailing spaces of the context move to the continuation, the
    whole string is tokenized, and the continuation's tokens are those after the context's own tokens."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        continuation = context[-spaces:] + continuation
        context = context[:-spaces]
    whole = tokenizer.encode(context + continuation)
    context_ids = tokenizer.encode(context)
    return context_ids, whole[len(context_ids):]


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))


def score_choices(model: Any, records: list[ChoiceRecord]) -> list[Scored]:
    """Each choice's summed log-likelihood given its context through ``model.logits`` (a
    :class:`~bridge_ext.inference.model.MegatronModel`: the checkpoint's own forward), harness-style: an empty
    context is the end-of-text token; a sequence longer than the model's context keeps its last tokens."""
    import torch

    tok = model.tokenizer
    scored = []
    for record in records:
        sums, counts = [], []
        for choice in record.choices:
            context_ids, choice_ids = encode_pair(tok, record.context, choice)
            if not context_ids:
                if tok.eod is None:
                    raise UserError(f"line {record.line}: an empty context needs an end-of-text token")
                context_ids = [tok.eod]
            if not choice_ids:
                raise UserError(f"line {record.line}: choice {choice!r} adds no token to its context")
            if len(choice_ids) > model.context:
                raise UserError(f"line {record.line}: choice {choice!r} has {len(choice_ids)} tokens; the model's "
                                f"context is {model.context}")
            ids = (context_ids + choice_ids)[-(model.context + 1):]
            inputs = torch.tensor([ids[:-1]], dtype=torch.long)
            device = next(model.module.parameters()).device
            logits = model.logits(inputs.to(device))[0]
            logprobs = torch.log_softmax(logits.double(), dim=-1)[-len(choice_ids):]
            targets = torch.tensor(choice_ids, device=logprobs.device).unsqueeze(-1)
            sums.append(float(logprobs.gather(-1, targets).sum()))
            counts.append(len(choice_ids))
        lengths = [len(c.encode("utf-8")) for c in record.choices]
        scored.append(Scored(record.line, record.label, sums, counts, lengths, _argmax(sums),
                             _argmax([s / n for s, n in zip(sums, lengths)])))
    return scored


def run_choices(*, ckpts: list[Path], choices: Path, iteration: int | None = None, every: bool = False,
                as_json: bool = False, checksums: bool = True, verbose: bool = False,
                tokenizer: Path | None = None) -> list[dict[str, Any]]:
    """``--choices``: acc and acc_norm of every selected iteration (docs/evaluate.md)."""
    from bridge_ext.inference.model import megatron_model

    records = read_choices(choices)
    plan = [(ckpt, number) for ckpt in ckpts
            for _, number in select_iterations(ckpt, iteration=iteration, every=every)]
    results = []
    for ckpt, number in plan:
        print(f"scoring {len(records)} records of {choices} with {ckpt} iteration {number} ...", file=sys.stderr,
              flush=True)
        with megatron_model(ckpt, iteration=number, tokenizer=tokenizer, checksums=checksums,
                            verbose=verbose) as model:
            scored = score_choices(model, records)
        acc = sum(s.pred == s.label for s in scored) / len(scored)
        acc_norm = sum(s.pred_norm == s.label for s in scored) / len(scored)
        summary = {"run": str(ckpt), "iteration": number, "choices": str(choices), "records": len(scored),
                   "acc": acc, "acc_norm": acc_norm}
        results.append(summary)
        if as_json:
            for s in scored:
                print(json.dumps({"run": str(ckpt), "iteration": number, **asdict(s)}), flush=True)
            print(json.dumps(summary), flush=True)
        else:
            print(f"{ckpt} iteration {number}: {len(scored)} records, acc {acc:.4f}, acc_norm {acc_norm:.4f}")
    return results
