"""``nemo llm generate``: one decoding loop over a Megatron checkpoint or a Hugging Face directory.

Decoding is KV-cached on both sides (Megatron: megatron-core's ``StaticInferenceContext`` in the model's own
forward, :class:`~bridge_ext.inference.model.KVSession`; transformers: its ``past_key_values``) and batched as
megatron-core's text-generation controller batches (:func:`decode_batch`). Each step takes the logits of the last
position over the model's own vocabulary and picks the next token:
greedy (``temperature 0``, the default: the arg-max, first index on ties, as ``torch.argmax`` and transformers'
greedy search) or sampled (logits / temperature, then top-k, then top-p over the sorted probabilities, keeping
at least one token, then one draw from a ``torch.Generator`` seeded with ``--seed``). It stops at the
tokenizer's end-of-text token, after ``--max-new-tokens``, or at the model's context.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bridge_ext.errors import UserError

__all__ = ["Sampling", "Generated", "decode_batch", "decode_loop", "read_prompts", "run_generate"]


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: all
    top_p: float = 1.0
    seed: int = 1234

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise UserError("--max-new-tokens must be at least 1")
        if self.temperature < 0:
            raise UserError("--temperature must be 0 (greedy) or positive")
        if self.top_k < 0:
            raise UserError("--top-k must be 0 (off) or positive")
        if not 0 < self.top_p <= 1:
            raise UserError("--top-p must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Generated:
    prompt: str
    text: str  # the continuation only
    prompt_tokens: int
    tokens: list[int]  # the continuation's ids
    stop: str  # "eos", "max_new_tokens" or "context"


def pick(logits: Any, sampling: Sampling, generator: Any) -> int:
    """The next token from a 1-D tensor of logits (see the module's docstring)."""
    import torch

    if sampling.greedy:
        return int(torch.argmax(logits))
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(logits, min(sampling.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        ordered, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
        drop = cumulative - torch.softmax(ordered, dim=-1) >= sampling.top_p  # keep the first token that crosses
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def decode_batch(model: Any, prompts: list[list[int]], sampling: Sampling, *,
                 on_token: Callable[[list[int]], None] | None = None) -> list[tuple[list[int], str]]:
    """Continue every prompt of ``prompts`` (token ids) together with ``model`` (a
    :class:`~bridge_ext.inference.model.MegatronModel` or :class:`~bridge_ext.inference.model.HFModel`) through one
    KV-cached session (``model.session``); returns each row's new ids and why it stopped.

    Static batching as megatron-core's text-generation controller does it: the prompts' common length is
    encoded in one pass, then every call feeds one position of every row, the prompt's own token while a row
    is still inside its prompt, else the token picked for it. Each row attends only to its own positions, so
    it is continued as it would be alone; each has its own sampler seeded with ``--seed``. ``on_token``
    (one prompt: the console stream) sees the first row's new ids after each token."""
    import torch

    rows = len(prompts)
    generators = [torch.Generator().manual_seed(sampling.seed) for _ in prompts]
    device = next(model.module.parameters()).device
    eos = model.tokenizer.eod
    ids = [list(p) for p in prompts]
    new: list[list[int]] = [[] for _ in prompts]
    stop: list[str | None] = [None] * rows
    session = model.session(rows)
    feed = [row[: min(map(len, prompts))] for row in ids]
    while True:
        logits = session(torch.tensor(feed, device=device))
        done = session.position  # positions in the cache: the logits predict position `done`
        for r in range(rows):
            if stop[r] is not None or len(ids[r]) > done:  # finished, or still inside its prompt
                continue
            token = pick(logits[r], sampling, generators[r])
            ids[r].append(token)
            new[r].append(token)
            if on_token is not None and r == 0:
                on_token(new[r])
            if eos is not None and token == eos:
                stop[r] = "eos"
            elif len(new[r]) >= sampling.max_new_tokens:
                stop[r] = "max_new_tokens"
            elif model.context and len(ids[r]) >= model.context:
                stop[r] = "context"
        if all(reason is not None for reason in stop):
            return [(n, reason) for n, reason in zip(new, stop)]
        feed = [[row[done] if len(row) > done else row[-1]] for row in ids]  # a finished row repeats its last


def decode_loop(model: Any, prompt_ids: list[int], sampling: Sampling, *,
                on_token: Callable[[list[int]], None] | None = None) -> tuple[list[int], str]:
    """One prompt (:func:`decode_batch` with one row)."""
    return decode_batch(model, [prompt_ids], sampling, on_token=on_token)[0]


def read_prompts(path: Path) -> list[str]:
    """``--prompts FILE``: JSONL with a ``prompt`` (or ``text``) field per line, or plain text, one per line."""
    if not path.is_file():
        raise UserError(f"--prompts {path} does not exist")
    prompts = []
    jsonl = path.suffix in (".jsonl", ".json")
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if jsonl:
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{number}: not JSON ({exc.msg})") from None
            text = record.get("prompt", record.get("text")) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise UserError(f"{path}:{number}: no \"prompt\" string")
            prompts.append(text)
        else:
            prompts.append(line)
    if not prompts:
        raise UserError(f"--prompts {path} holds no prompt")
    return prompts


def _encode(model: Any, prompt: str, sampling: Sampling) -> list[int]:
    ids = model.tokenizer.encode(prompt)
    if not ids:
        raise UserError("the prompt is empty after tokenization")
    if model.context and len(ids) >= model.context:
        raise UserError(f"the prompt is {len(ids):,} tokens, the model's context is {model.context:,}: shorten it")
    return ids


class _Stream:
    """Prints the continuation as it grows (whole characters only: a token may end inside a UTF-8 sequence)."""

    def __init__(self, model: Any, out: Any):
        self.model, self.out, self.shown = model, out, ""

    def __call__(self, new: list[int]) -> None:
        text = self.model.tokenizer.decode(new)
        if text.endswith("\ufffd") or not text.startswith(self.shown):  # wait for whole characters
            return
        self.out.write(text[len(self.shown):])
        self.out.flush()
        self.shown = text

    def finish(self, text: str) -> None:
        common = 0
        while common < min(len(text), len(self.shown)) and text[common] == self.shown[common]:
            common += 1
        self.out.write(text[common:] + "\n")
        self.out.flush()


def generate_all(model: Any, prompts: list[str], sampling: Sampling, *, stream: Any = None,
                 batch_size: int = 1) -> list[Generated]:
    """Every prompt's continuation: streamed one prompt at a time to ``stream``, else ``batch_size`` prompts
    decoded together (:func:`decode_batch`)."""
    encoded = [_encode(model, prompt, sampling) for prompt in prompts]  # every prompt checked before decoding
    results = []
    if stream is not None:
        for prompt, ids in zip(prompts, encoded):
            stream.write(prompt)
            on_token = _Stream(model, stream)
            new, stop = decode_loop(model, ids, sampling, on_token=on_token)
            text = model.tokenizer.decode(new)
            on_token.finish(text)
            results.append(Generated(prompt, text, len(ids), new, stop))
        return results
    for first in range(0, len(prompts), batch_size):
        chunk = encoded[first: first + batch_size]
        for prompt, ids, (new, stop) in zip(prompts[first: first + batch_size], chunk,
                                            decode_batch(model, chunk, sampling)):
            results.append(Generated(prompt, model.tokenizer.decode(new), len(ids), new, stop))
    return results


def run_generate(*, ckpt: Path | None, hf: Path | None, prompts: list[str], sampling: Sampling,
                 iteration: int | None = None, tokenizer: Path | None = None, out: Path | None = None,
                 as_json: bool = False, checksums: bool = True, verbose: bool = False,
                 batch_size: int = 8, tp: int = 1) -> list[Generated]:
    """The command: prompts in, continuations out (streamed to stdout for console use; JSONL to ``out`` or, with
    ``as_json``, to stdout). Returns them.

    ``tp`` > 1: under torchrun, every process runs the same loop on its shard of the model (logits gathered, so
    every process picks the same tokens: the same arg-max, the same seeded draws); rank 0 alone prints and
    writes."""
    from bridge_ext.runtime import is_rank_zero

    sampling.check()
    if batch_size < 1:
        raise UserError("--batch-size must be at least 1")
    if out is not None and not out.parent.is_dir():
        raise UserError(f"--out {out}: directory {out.parent} does not exist")
    err = sys.stderr  # the real one: loading the model hides upstream output

    main = is_rank_zero()

    def say(line: str) -> None:
        if main:
            print(line, file=err, flush=True)

    stream = None if (out is not None or as_json) else sys.stdout
    if stream is not None and not main:
        import io

        stream = io.StringIO()  # the same loop, one prompt at a time, shown by rank 0 only
    if ckpt is not None:
        from bridge_ext.inference.model import megatron_model

        with megatron_model(ckpt, iteration=iteration, tokenizer=tokenizer, checksums=checksums,
                            verbose=verbose, tp=tp) as model:
            say(f"generate: {model.description}; tokenizer {model.tokenizer.description}; "
                f"{'greedy' if sampling.greedy else 'sampling'}")
            results = generate_all(model, prompts, sampling, stream=stream, batch_size=batch_size)
    else:
        from bridge_ext.inference.model import hf_model

        model = hf_model(hf, tokenizer=tokenizer)
        say(f"generate: {model.description}; tokenizer {model.tokenizer.description}; "
            f"{'greedy' if sampling.greedy else 'sampling'}")
        results = generate_all(model, prompts, sampling, stream=stream, batch_size=batch_size)
    if (out is not None or as_json) and main:
        lines = "".join(json.dumps(asdict(r)) + "\n" for r in results)
        if out is not None:
            from bridge_ext.runtime import write_atomic

            write_atomic(out, lines)
            say(f"wrote {len(results)} continuations to {out}")
        else:
            sys.stdout.write(lines)
    return results
