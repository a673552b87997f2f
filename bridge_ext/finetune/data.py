"""Fine-tuning data: a local JSONL -> Megatron Bridge's SFT dataset files, rendered with the chat template.

Input records, one JSON object per line:

* ``{"input": "...", "output": "..."}``: one user turn and the answer;
* ``{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": "..."}, ...]}`` ending with an
  assistant turn.

Every record is rendered with the tokenizer's own chat template (``apply_chat_template``): the prompt is
all turns before the last assistant turn with the generation prompt, the answer is what the full
conversation adds after it. Both are written as ``{"input": prompt, "output": answer}`` lines, which Megatron
Bridge's ``GPTSFTDataset`` reads with ``answer_only_loss``: loss on the answer tokens only (earlier assistant
turns are context). This works with any template; Megatron Bridge's own chat path masks per turn only for
templates that carry ``{% generation %}`` markers, which Qwen3's and Kimi K2's do not have (without them it
puts loss on every token).

Files go to a cache directory keyed by the data's bytes and the tokenizer's files
(``$MUON_RECIPES_CACHE/sft/<key>/training.jsonl`` + ``validation.jsonl``: every ``VAL_EVERY``-th record
held out); nothing is written before every record has been read, checked and rendered.

The data-order seed: Megatron Bridge's SFT dataset reads ``training.jsonl`` in file order (its
``max_train_samples`` mapping shuffles with a fixed seed, 1, not ``dataset.seed``), so two seeds of a full SFT
run would see the same batches. ``prepare_sft_data(..., seed=S)`` writes the training records in the order
of ``random.Random(S).shuffle`` (a directory per seed; the run passes ``dataset.seed``); the held-out records
stay in file order, so every seed is evaluated on the same batches.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bridge_ext.errors import UserError
from bridge_ext.runtime import rename_into_place

__all__ = ["PROMPT_TEMPLATE", "VAL_EVERY", "SFTData", "load_records", "prepare_sft_data", "render_record",
           "render_records", "sft_dataset_kwargs", "tokenizer_files_digest"]

VAL_EVERY = 10  # every 10th record is held out for the eval loss (Megatron Bridge's SQuAD default: 10 %)
PROMPT_TEMPLATE = "{input}{output}"  # the rendered prompt already ends where the answer starts
_FORMAT = 1
_ROLES = frozenset({"system", "user", "assistant", "tool"})


@dataclass(frozen=True)
class SFTData:
    root: Path  # dataset_root for Megatron Bridge's FinetuningDatasetConfig
    train: int
    validation: int
    built: bool


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """Read and check a JSONL file; every problem is one ``UserError`` line naming the line number."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"data file {path} does not exist; pass a JSONL file with one "
                        '{"input": ..., "output": ...} or {"messages": [...]} object per line')
    records = []
    with path.open(encoding="utf-8", errors="strict") as handle:
        try:
            lines = list(handle)
        except UnicodeDecodeError:
            raise UserError(f"data file {path} is not UTF-8 text") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path} line {number} is not valid JSON ({exc.msg}); "
                            "each line must be one JSON object") from None
        records.append(_check_record(record, f"{path} line {number}"))
    if not records:
        raise UserError(f"data file {path} is empty; it needs at least one record per line")
    return records


def _check_record(record: Any, where: str) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise UserError(f"{where} is a {type(record).__name__}, not an object with \"input\"/\"output\" or \"messages\"")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise UserError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
        for i, message in enumerate(messages):
            if (not isinstance(message, dict) or message.get("role") not in _ROLES
                    or not isinstance(message.get("content"), str)):
                raise UserError(f"{where}: message {i} needs \"role\" (one of {', '.join(sorted(_ROLES))}) and "
                                "a string \"content\"")
        if messages[-1]["role"] != "assistant":
            raise UserError(f"{where}: the last message must be the assistant's answer (role \"assistant\")")
        if not any(m["role"] != "assistant" for m in messages):
            raise UserError(f"{where}: the conversation has no prompt (no user or system message)")
        return {"messages": messages}
    if isinstance(record.get("input"), str) and isinstance(record.get("output"), str):
        return {"messages": [{"role": "user", "content": record["input"]},
                             {"role": "assistant", "content": record["output"]}]}
    keys = ", ".join(sorted(map(str, record))) or "none"
    raise UserError(f"{where} has keys {keys}; each record needs string \"input\" and \"output\", "
                    "or \"messages\"")


def _chat_template_check(tokenizer: Any, name: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"the tokenizer in {name} has no chat template; add one (chat_template.jinja or "
                        "tokenizer_config.json's chat_template) or use a tokenizer that ships one")


def render_record(tokenizer: Any, record: dict[str, Any]) -> dict[str, str]:
    """``{"input": prompt, "output": answer}`` rendered with the tokenizer's chat template."""
    messages = record["messages"]
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    if not full.startswith(prompt):
        raise UserError("the tokenizer's chat template renders the conversation differently with and without "
                        "its last answer; fine-tuning needs a template whose prompt is a prefix of the chat")
    return {"input": prompt, "output": full[len(prompt):]}


def render_records(tokenizer: Any, records: Iterable[dict[str, Any]], *, name: str) -> list[dict[str, str]]:
    _chat_template_check(tokenizer, name)
    return [render_record(tokenizer, r) for r in records]


def tokenizer_files_digest(tokenizer_dir: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(Path(tokenizer_dir).iterdir()):
        if path.is_file() and (path.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab",
                                                     "merges", "added_tokens"))):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def sft_dataset_kwargs() -> dict[str, Any]:
    """``dataset_kwargs`` for Megatron Bridge's SFT dataset (``data/datasets/sft.py`` ``create_sft_dataset`` in
    0.3-0.5, ``data/builders/gpt_sft.py`` ``build_gpt_sft_split`` in 0.6): the rendered prompt, loss on the answer."""
    return {"prompt_template": PROMPT_TEMPLATE, "label_key": "output", "truncation_field": "input",
            "answer_only_loss": True, "add_eos": True, "add_bos": False, "add_sep": False}


def prepare_sft_data(data: str | Path, tokenizer_dir: str | Path, *, cache: Path, seed: int | None = None) -> SFTData:
    """Check and render ``data`` with the tokenizer in ``tokenizer_dir``; write the split once per content.

    ``seed``: the training records' order (``random.Random(seed).shuffle``); None keeps the file order."""
    from transformers import AutoTokenizer

    data, tokenizer_dir = Path(data), Path(tokenizer_dir)
    records = load_records(data)
    if len(records) < 2:
        raise UserError(f"data file {data} has {len(records)} record; at least 2 are needed "
                        f"(every {VAL_EVERY}th record is held out for the eval loss, and at least one)")
    if not tokenizer_dir.is_dir():
        raise UserError(f"cannot load the tokenizer in {tokenizer_dir} (no such directory)")
    key = hashlib.sha256(f"format={_FORMAT}\0{VAL_EVERY}\0".encode() + data.read_bytes()
                         + tokenizer_files_digest(tokenizer_dir).encode()).hexdigest()[:20]
    if seed is not None:
        key += f"-s{int(seed)}"
    final = cache / "sft" / key
    if (final / "validation.jsonl").is_file():  # these bytes were checked and rendered with this tokenizer before
        built = json.loads((final / "source.json").read_text())
        return SFTData(final, built["train"], built["validation"], built=False)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot load the tokenizer in {tokenizer_dir} ({str(exc).splitlines()[0]})") from None
    rendered = render_records(tokenizer, records, name=str(tokenizer_dir))
    held = {i for i in range(len(rendered)) if i % VAL_EVERY == VAL_EVERY - 1} or {len(rendered) - 1}
    train = [r for i, r in enumerate(rendered) if i not in held]
    if seed is not None:
        random.Random(int(seed)).shuffle(train)
    validation = [r for i, r in enumerate(rendered) if i in held]
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create the data cache {final.parent} ({exc.strerror}); set $MUON_RECIPES_CACHE") from None
    tmp = final.parent / f".tmp-{key}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for name, rows in (("training", train), ("validation", validation)):
            with (tmp / f"{name}.jsonl").open("w", encoding="utf-8") as out:
                for row in rows:
                    out.write(json.dumps(row, ensure_ascii=False) + "\n")
        (tmp / "source.json").write_text(json.dumps({"data": str(data.absolute()), "tokenizer": str(tokenizer_dir),
                                                     "train": len(train), "validation": len(validation),
                                                     "seed": seed}) + "\n")
        rename_into_place(tmp, final, marker="validation.jsonl")  # or a concurrent process's same content
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return SFTData(final, len(train), len(validation), built=True)
