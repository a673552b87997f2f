"""The shipped instruction set: docstring -> signature pairs from the Python standard library's own sources.

Every function of the standard-library corpus (``bridge_ext.data.corpus_files``: the files the proxies are
pre-trained on, in the same fixed order) with a public name and a docstring gives one record:

    {"input": "Write the signature of the Python function documented as: <first docstring paragraph>",
     "output": "def <name>(<parameters>):"}

Learnable (the parameter names usually appear in the docstring) and checkable, built offline in a second,
the same on every machine with the same standard library. Written once to the cache
(``$MUON_RECIPES_CACHE/sft/stdlib-signatures-<key>.jsonl``); ``--data stdlib-signatures`` names it.
"""

from __future__ import annotations

import ast
import hashlib
import json
from pathlib import Path

from bridge_ext.runtime import write_atomic

__all__ = ["BUILTIN_SETS", "MAX_RECORDS", "instruction_records", "stdlib_signatures"]

MAX_RECORDS = 640  # 576 to train (40 proxy iterations x 8 see 320: no repetition), 64 held out (8 eval batches)
_FORMAT = 1
_MAX_DOC_CHARS = 240  # keeps prompt + answer inside the CPU proxies' 128-token sequence
_MAX_SIGNATURE_CHARS = 100
_PROMPT = "Write the signature of the Python function documented as: "


def _first_paragraph(doc: str) -> str:
    return " ".join(doc.strip().split("\n\n")[0].split())


def instruction_records(limit: int = MAX_RECORDS) -> list[dict[str, str]]:
    """The records, in corpus order, without duplicates (same prompt), at most ``limit``."""
    from bridge_ext.data import corpus_files, read_document

    out, seen = [], set()
    for item in corpus_files():
        try:
            tree = ast.parse(read_document(item))
        except SyntaxError:  # a few stdlib files are templates or Python 2 on purpose
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc:
                continue
            text = _first_paragraph(doc)
            signature = f"def {node.name}({ast.unparse(node.args)}):"
            if len(text) < 20 or len(text) > _MAX_DOC_CHARS or len(signature) > _MAX_SIGNATURE_CHARS:
                continue
            prompt = _PROMPT + text
            if prompt in seen:
                continue
            seen.add(prompt)
            out.append({"input": prompt, "output": signature})
            if len(out) >= limit:
                return out
    return out


def stdlib_signatures(cache: Path, *, limit: int = MAX_RECORDS) -> Path:
    """The instruction set as a JSONL file in ``cache``, built once per corpus (file names and sizes) and limit."""
    from bridge_ext.data import corpus_files

    digest = hashlib.sha256(f"{_FORMAT}\0{limit}\0".encode())
    for item in corpus_files():
        digest.update(f"{item.name}\0{item.size}\0".encode())
    path = cache / "sft" / f"stdlib-signatures-{digest.hexdigest()[:16]}.jsonl"
    if not path.is_file():
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in instruction_records(limit))
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text)  # UTF-8
    return path


BUILTIN_SETS = {"stdlib-signatures": stdlib_signatures}
