"""``nemo llm prepare-data --input``: user corpora, the model's own tokenizer (Qwen3-style HF, Kimi K2 tiktoken
without remote code), blends, reuse, bad input; and the real-data path into ``nemo llm pretrain``.

The tokenizers are made here: a Qwen-style directory (transformers' ``Qwen2TokenizerFast`` around the shipped
byte-level BPE) and a Kimi-K2-style directory (``tiktoken.model`` from a small BPE trained on a multilingual
sample, ``tokenizer_config.json`` with special tokens and an ``auto_map`` to a ``tokenization_kimi.py`` that
raises if anything ever imports it). Expected ids come from ``tiktoken`` / ``transformers`` directly.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import os
import shlex
from pathlib import Path

import pytest

from bridge_ext import corpus
from bridge_ext.data import PROXY_TOKENIZER_DIR
from tests.nemo_cli import Result


# Kimi K2's pre-tokenizer pattern as published in its tokenization_kimi.py (TikTokenTokenizer.pat_str),
# written out here independently of bridge_ext.tokenizers.
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

MULTILINGUAL = [
    "The quick brown fox jumps over the lazy dog. I'll say it's 12345, we've got 3.14159!",
    "中文文本的分词测试，汉字连续出现。大规模语言模型的预训练。",
    "日本語のテキストとカタカナ、ひらがな。東京都",
    "Привет, мир! Как дела? Ёжик в тумане.",
    "مرحبا بالعالم، كيف حالك؟",
    "emoji 🙂🚀 and   spaces\n\n\ttabs\r\nCRLF   ",
    "def f(x):\n    return x ** 2  # héllo wörld, naïve café",
    "Ελληνικά κείμενα και हिन्दी पाठ और 한국어 텍스트",
]
# Kimi's special tokens in this test's vocabulary: offsets after the base ranks (as in Kimi K2's config)
KIMI_SPECIALS = {0: "[BOS]", 1: "[EOS]", 3: "<|im_end|>", 4: "<|im_user|>", 255: "[PAD]"}


def nemo_llm(argv: list[str]) -> int:
    from bridge_ext import commands

    return commands.main(["llm", *argv])


def _train_bpe(texts: list[str], vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (openai/gpt-2 encoder.py ``bytes_to_unicode``), which byte-level
    BPE vocabularies are written in: printable Latin-1 bytes map to themselves, the other 68 to U+0100 on, in
    byte order. Written out here: transformers 5 no longer has it in ``models/gpt2/tokenization_gpt2.py``."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table = {b: chr(b) for b in printable}
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + len(table) - len(printable))
    return table


def make_kimi_dir(out: Path, vocab: int = 700) -> int:
    """A Kimi-K2-style tokenizer directory; returns the number of base (tiktoken) ranks."""
    from tokenizers import pre_tokenizers

    to_char = gpt2_bytes_to_unicode()
    assert set(to_char.values()) == set(pre_tokenizers.ByteLevel.alphabet())  # the BPE's alphabet

    texts = MULTILINGUAL * 30 + [p.read_text() for p in sorted(Path(os.__file__).parent.glob("json/*.py"))]
    model = json.loads(_train_bpe(texts, vocab).to_str())["model"]
    to_byte = {v: k for k, v in to_char.items()}
    ranks = {bytes([b]): b for b in range(256)}  # tiktoken: every byte, then each merge's result by merge order
    for left, right in model["merges"]:
        token = bytes(to_byte[c] for c in left) + bytes(to_byte[c] for c in right)
        ranks.setdefault(token, len(ranks))
    out.mkdir(parents=True)
    (out / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    base = len(ranks)
    added = {str(base + i): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                             "single_word": False, "special": True} for i, name in KIMI_SPECIALS.items()}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": added, "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]",
        "model_max_length": 1048576, "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}, indent=1))
    (out / "tokenization_kimi.py").write_text("raise RuntimeError('remote code ran')\n")  # must never be imported
    return base


def make_qwen_dir(out: Path) -> Path:
    """The shipped 4096-token BPE saved by transformers' Qwen2TokenizerFast (tokenizer.json, vocab.json, merges.txt)."""
    from tokenizers import Tokenizer
    from transformers import Qwen2TokenizerFast

    fast = Qwen2TokenizerFast(tokenizer_object=Tokenizer.from_file(str(PROXY_TOKENIZER_DIR / "tokenizer.json")),
                              eos_token="<|endoftext|>", pad_token="<|pad|>", unk_token=None, bos_token=None)
    fast.save_pretrained(str(out))
    return out


def direct_kimi_encoding(directory: Path, base: int):
    """tiktoken's own loader and Encoding with Kimi's rules (256 reserved specials after the base ranks)."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    path = directory / "tiktoken.model"
    ranks = load_tiktoken_bpe(str(path), expected_hash=hashlib.sha256(path.read_bytes()).hexdigest())
    assert len(ranks) == base
    specials = {KIMI_SPECIALS.get(i, f"<|reserved_token_{base + i}|>"): base + i for i in range(256)}
    return tiktoken.Encoding("direct", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    base = make_kimi_dir(root / "Kimi-K2-Instruct")
    return {"kimi": root / "Kimi-K2-Instruct", "kimi_base": base, "qwen": make_qwen_dir(root / "Qwen3-8B")}


@pytest.fixture
def tiktoken_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken-cache"))
    monkeypatch.setenv("MUON_RECIPES_CACHE", str(tmp_path / "cache"))


def stdlib_documents(count: int, start: int = 0) -> list[str]:
    return [p.read_text() for p in sorted(Path(os.__file__).parent.glob("*.py"))[start:start + count]]


def write_jsonl(path: Path, texts: list[str], key: str = "text", opener=open) -> Path:
    with opener(path, "wt", encoding="utf-8") as handle:
        for i, text in enumerate(texts):
            handle.write(json.dumps({"id": i, key: text}) + "\n")
    return path


def read_dataset(prefix: str | Path) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))
    return [dataset[i].tolist() for i in range(len(dataset))]


# ---------------------------------------------------------------------------------------------- tokenizers
@pytest.mark.once
def test_kimi_tiktoken_ids_specials_and_round_trip(dirs, tiktoken_cache):
    from bridge_ext.tokenizers import load_tokenizer

    base = dirs["kimi_base"]
    direct = direct_kimi_encoding(dirs["kimi"], base)
    tok = load_tokenizer(dirs["kimi"])  # would raise RuntimeError if tokenization_kimi.py were imported
    assert tok.kind == "tiktoken" and tok.vocab_size == base + 256 == direct.n_vocab
    for text in MULTILINGUAL:
        assert tok.encode(text) == direct.encode(text, allowed_special="all")
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode_batch(MULTILINGUAL, threads=2) == direct.encode_batch(MULTILINGUAL, allowed_special="all")
    # special tokens: the config's ids, also inside text (as Kimi's encode allows them)
    assert tok.eod == base + 1  # [EOS]
    assert tok.encode("<|im_end|>") == [base + 3]
    assert tok.encode("a[BOS]b")[1] == base
    assert tok.encode(f"<|reserved_token_{base + 7}|>") == [base + 7]
    # Han runs are their own pre-tokens: no token spans a Han/Latin boundary
    pieces = [direct.decode_single_token_bytes(i).decode("utf-8", "replace") for i in tok.encode("abc中文def")]
    assert "".join(pieces) == "abc中文def" and not any("c中" in p or "文d" in p for p in pieces)
    # tokenization_kimi.py encodes runs of more than 25,000 non-whitespace characters in 25,000-character pieces
    pair = next(t for t in (direct.decode_single_token_bytes(r) for r in range(256, base)) if len(t) == 2
                and t.isalpha()).decode()  # a merged two-letter token: the cut at 25,000 falls inside one
    long = "x" + pair * 15_000
    assert tok.encode(long) == direct.encode(long[:25_000]) + direct.encode(long[25_000:])
    assert tok.encode(long) != direct.encode(long)


@pytest.mark.stack  # transformers' class and save format for the directory differ between 4 and 5
def test_qwen_style_dir_encodes_as_transformers(dirs):
    import transformers
    from transformers import AutoTokenizer

    from bridge_ext.tokenizers import load_tokenizer

    tok = load_tokenizer(dirs["qwen"])
    hf = AutoTokenizer.from_pretrained(str(dirs["qwen"]), trust_remote_code=False)
    assert type(hf) is transformers.Qwen2TokenizerFast  # transformers 5: an alias of Qwen2Tokenizer, the fast one
    assert tok.kind == "huggingface" and tok.vocab_size == len(hf) == 4096 and tok.eod == hf.eos_token_id == 0
    assert tok.encode_batch(MULTILINGUAL) == hf(MULTILINGUAL, add_special_tokens=False).input_ids
    assert all(tok.decode(tok.encode(t)) == t for t in MULTILINGUAL)


@pytest.mark.stack  # the conversion is transformers' TikTokenConverter, the loading Megatron Bridge's
def test_kimi_tokenizer_in_megatron_bridge_gives_the_same_ids(dirs, tiktoken_cache):
    """What `pretrain` builds from the converted directory (Megatron Bridge's own build_tokenizer)."""
    from bridge_ext import patches
    from bridge_ext.tokenizers import megatron_tokenizer_dir

    patches.apply("import")
    from megatron.bridge.training.tokenizers.config import TokenizerConfig
    from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer

    base = dirs["kimi_base"]
    direct = direct_kimi_encoding(dirs["kimi"], base)
    converted = megatron_tokenizer_dir(dirs["kimi"])
    assert converted != dirs["kimi"] and megatron_tokenizer_dir(dirs["kimi"]) == converted  # cached
    assert not (converted / "tokenization_kimi.py").exists()
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(converted),
                                          hf_tokenizer_kwargs={"use_fast": True, "trust_remote_code": False}))
    assert tok.vocab_size == base + 256 and tok.eod == base + 1
    for text in [*MULTILINGUAL, "x <|im_end|> y"]:
        assert tok.tokenize(text) == direct.encode(text, allowed_special="all"), text
        assert tok.detokenize(tok.tokenize(text)) == text


# ------------------------------------------------------------------------------------------------ datasets
@pytest.mark.once
def test_every_format_into_one_indexed_dataset(dirs, tmp_path):
    from transformers import AutoTokenizer

    docs = stdlib_documents(9)
    src = tmp_path / "src"
    src.mkdir()
    write_jsonl(src / "a.jsonl", docs[0:2] + [""])  # an empty document is skipped
    write_jsonl(src / "b.jsonl.gz", docs[2:4], opener=gzip.open)
    import zstandard

    raw = "".join(json.dumps({"text": t}) + "\n" for t in docs[4:6]).encode()
    (src / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": docs[6:8], "n": [1, 2]}), src / "d.parquet")
    (src / "e.txt").write_text(docs[8])
    out = tmp_path / "out" / "mixed"
    prepared = corpus.prepare_corpus([[str(src / "*")]], tokenizer=dirs["qwen"], out=out, append_eod=True,
                                     quiet=True)
    assert prepared.prefixes == [str(out)] and prepared.built == [True]
    hf = AutoTokenizer.from_pretrained(str(dirs["qwen"]))
    expected = [ids + [0] for ids in hf(docs, add_special_tokens=False).input_ids]  # + <|endoftext|>
    assert read_dataset(out) == expected
    record = json.loads(Path(f"{out}.json").read_text())
    assert record["documents"] == 9 and record["empty_documents_skipped"] == 1
    assert record["tokens"] == sum(map(len, expected))
    assert sorted(p.name for p in out.parent.iterdir()) == ["mixed.bin", "mixed.idx", "mixed.json", "mixed.yaml"]


@pytest.mark.once
def test_workers_and_batches_give_identical_datasets(dirs, tmp_path, tiktoken_cache, monkeypatch):
    texts = MULTILINGUAL * 5 + stdlib_documents(4)
    write_jsonl(tmp_path / "c.jsonl", texts)
    monkeypatch.setattr(corpus, "_BATCH_DOCS", 7)  # several batches through the read/encode/write pipeline
    outs = []
    for workers in (1, 3):
        out = tmp_path / f"w{workers}"
        corpus.prepare_corpus([[str(tmp_path / "c.jsonl")]], tokenizer=dirs["kimi"], out=out, workers=workers,
                              quiet=True)
        outs.append(out)
    for suffix in (".bin", ".idx"):
        assert Path(f"{outs[0]}{suffix}").read_bytes() == Path(f"{outs[1]}{suffix}").read_bytes()
    direct = direct_kimi_encoding(dirs["kimi"], dirs["kimi_base"])
    assert read_dataset(outs[0]) == [direct.encode(t, allowed_special="all") for t in texts]


@pytest.mark.once
def test_same_inputs_reuse_other_inputs_need_overwrite(dirs, tmp_path, capsys):
    source = write_jsonl(tmp_path / "c.jsonl", stdlib_documents(3))
    args = ["prepare-data", "--input", str(source), "--tokenizer", str(dirs["qwen"]), "--out", str(tmp_path / "d"),
            "--quiet"]
    assert nemo_llm(args) == 0
    out = capsys.readouterr().out
    assert "built in" in out and "dataset.blend='[[\"" in out and f"--yaml {tmp_path / 'd.yaml'}" in out
    stamp = os.stat(tmp_path / "d.bin").st_mtime_ns
    assert nemo_llm(args) == 0
    assert "cached: same inputs" in capsys.readouterr().out
    assert os.stat(tmp_path / "d.bin").st_mtime_ns == stamp
    write_jsonl(source, stdlib_documents(2))  # other content under the same name
    assert nemo_llm(args) == 2
    err = capsys.readouterr().err
    assert err == f"error: {tmp_path / 'd.bin'} exists (made from other inputs or options); pass --overwrite to " \
                  "replace it, or choose another --out\n"
    assert os.stat(tmp_path / "d.bin").st_mtime_ns == stamp
    assert nemo_llm([*args, "--overwrite"]) == 0 and "built in" in capsys.readouterr().out
    assert len(read_dataset(tmp_path / "d")) == 2


@pytest.mark.once
@pytest.mark.parametrize("case", ["missing", "glob", "empty", "key", "json", "tokenizer", "exists", "weights"])
def test_bad_input_is_one_line_and_leaves_nothing(case, dirs, tmp_path, capsys):
    good = write_jsonl(tmp_path / "good.jsonl", ["some text", "more text"])
    inputs, tokenizer, expected = [str(good)], str(dirs["qwen"]), None
    extra: list[str] = []
    if case == "missing":
        inputs, expected = [str(tmp_path / "nope.jsonl")], f"input file {tmp_path / 'nope.jsonl'} does not exist"
    elif case == "glob":
        inputs, expected = [str(tmp_path / "*.parquet")], f"no file matches --input {tmp_path / '*.parquet'}"
    elif case == "empty":
        (tmp_path / "empty.jsonl").write_text('\n{"text": ""}\n\n')
        inputs, expected = [str(tmp_path / "empty.jsonl")], "no text in"
    elif case == "key":
        (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n\n{"content": "b"}\n')
        inputs = [str(tmp_path / "bad.jsonl")]
        expected = f"{tmp_path / 'bad.jsonl'} line 3: no 'text' key (has 'content'); name the text field with --text-key"
    elif case == "json":
        (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": \n')
        inputs, expected = [str(tmp_path / "bad.jsonl")], f"{tmp_path / 'bad.jsonl'} line 2: not JSON"
    elif case == "tokenizer":
        (tmp_path / "model").mkdir()
        (tmp_path / "model" / "config.json").write_text("{}")
        tokenizer, expected = str(tmp_path / "model"), f"no tokenizer files in {tmp_path / 'model'}"
    elif case == "exists":
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "d.bin").write_bytes(b"someone else's")
        expected = f"{tmp_path / 'out' / 'd.bin'} exists"
    elif case == "weights":
        extra, expected = ["--weights", "1", "2"], "2 --weights for 1 --input sets"
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    code = nemo_llm(["prepare-data", "--input", *inputs, "--tokenizer", tokenizer, "--out",
                     str(tmp_path / "out" / "d"), "--quiet", *extra])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: {expected}") and err.count("\n") == 1, err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing partial, no temp files


# ------------------------------------------------------------------------------- the real-data path, end to end
def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run / "losses.jsonl").read_text().splitlines()) if "loss" in r]


def _document_ranges(prefix: str) -> dict[str, set[int]]:
    """The documents Megatron's GPTDataset put in each split (its own index cache next to the dataset)."""
    import numpy as np

    out = {}
    for path in (Path(prefix) / "cache").rglob("*-GPTDataset-*-document_index.npy"):
        out[path.name.split("-")[-2]] = set(np.load(path).tolist())
    return out


def _pretrain(nemo, tmp_path: Path, argv: list[str], *overrides: str) -> tuple[Result, Path]:
    run = tmp_path / "run"
    result = nemo(["llm", *argv, "--device", "cpu", *overrides, f"checkpoint.save={run}", f"checkpoint.load={run}",
                   f"logger.tensorboard_dir={run}/tb"], cwd=tmp_path)
    assert result.code == 0, result.stderr[-3000:]
    return result, run


DOCS = Path(__file__).resolve().parents[1] / "docs" / "data.md"


def doc_commands(section: str) -> list[list[str]]:
    """The commands of a ``docs/data.md`` section as argv lists (``\\`` continuations joined)."""
    text = DOCS.read_text().split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    commands, current = [], ""
    for line in text.splitlines():
        if line.startswith("    ") and (current or line.strip().startswith(("nemo llm", "torchrun"))):
            current += " " + line.strip().rstrip("\\")
            if not line.rstrip().endswith("\\"):
                commands.append(shlex.split(current))
                current = ""
    return commands


def _as_cpu_run(launch: list[str], proxy: str) -> list[str]:
    """The docs' GPU launch line as the CPU run of the family's proxy: ``llm pretrain`` on, recipe swapped,
    the GPU layout dropped."""
    argv = launch[launch.index("llm") + 1:]
    argv[argv.index("--recipe") + 1] = proxy
    if "--layout" in argv:
        del argv[argv.index("--layout"):argv.index("--layout") + 2]
    return argv


@pytest.mark.slow
def test_docs_qwen3_path_blend_trains_and_megatron_honours_the_split(dirs, tmp_path, capsys, monkeypatch, nemo):
    """docs/data.md, Qwen3, command by command: two JSONL sets with weights -> blend YAML -> the dry run of
    qwen3_8b_muon (and its refusal of a tokenizer that does not fit) -> training (qwen3_proxy_muon on CPU)."""
    prepare, dryrun, launch = doc_commands("Qwen3")
    assert prepare[:3] == ["nemo", "llm", "prepare-data"] and dryrun[-1] == "--dryrun" and launch[0] == "torchrun"
    monkeypatch.setenv("MUON_RECIPES_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus" / "web").mkdir(parents=True)
    write_jsonl(tmp_path / "corpus" / "web" / "a.jsonl", stdlib_documents(25, 0))
    write_jsonl(tmp_path / "corpus" / "web" / "b.jsonl", stdlib_documents(15, 25))
    write_jsonl(tmp_path / "corpus" / "code.jsonl.gz", stdlib_documents(20, 40), opener=gzip.open)
    models = {"/models/Qwen3-8B": str(dirs["qwen"])}
    assert nemo_llm([models.get(a, a) for a in prepare[2:]] + ["--quiet"]) == 0
    blend, yaml_path = tmp_path / "data" / "qwen3", tmp_path / "data" / "qwen3.yaml"
    out = capsys.readouterr().out
    assert f"--yaml {yaml_path}" in out and "split     80,10,10: 32 / 4 / 4 documents" in out
    # the printed overrides (for a shell) say what the YAML says
    overrides = shlex.split(next(line for line in out.splitlines() if line.startswith("overrides "))[10:])
    assert nemo_llm(["pretrain", "--recipe", "qwen3_proxy_muon", *overrides, "--to-yaml", "via-overrides.yaml"]) == 0
    assert nemo_llm(["pretrain", "--recipe", "qwen3_proxy_muon", "--yaml", str(yaml_path), "--to-yaml",
                     "via-yaml.yaml"]) == 0
    assert (tmp_path / "via-overrides.yaml").read_text() == (tmp_path / "via-yaml.yaml").read_text()
    capsys.readouterr()
    # the dry run of the full recipe checks the tokenizer against the model's vocabulary ...
    assert nemo_llm(dryrun[2:]) == 0
    out = capsys.readouterr().out
    from transformers import Qwen2TokenizerFast  # the class transformers loads it with (5: named Qwen2Tokenizer)

    assert f"tokenizer   {Qwen2TokenizerFast.__name__} (4,096 tokens) from {dirs['qwen']}, end of document id 0; " \
           "fits model.vocab_size 151,936" in out
    assert f"dataset.blend=[['{blend}-0', '{blend}-1'], [0.7, 0.3]]" in out
    # ... and refuses one whose ids do not fit the embedding
    assert nemo_llm([*dryrun[2:], "model.vocab_size=4000"]) == 2
    assert capsys.readouterr().err == (
        f"error: the tokenizer in {dirs['qwen']} has 4,096 tokens but model.vocab_size is 4,000: its ids would not "
        "fit the embedding; use the model's own tokenizer (or a model with a larger vocabulary)\n")
    result, run = _pretrain(nemo, tmp_path, _as_cpu_run(launch, "qwen3_proxy_muon"), "train.train_iters=12")
    assert f"data: dataset.blend=[['{blend}-0', '{blend}-1'], [0.7, 0.3]]" in result.stderr
    losses = _losses(run)
    assert len(losses) == 12 and losses[0] > 8.0 and losses[-1] < losses[0] - 0.5, losses  # ln 4096 = 8.32
    # 80,10,10 over 40 and 20 documents: Megatron's GPTDataset takes documents [0,32) [32,36) [36,40) and
    # [0,16) [16,18) [18,20) (bounds: round(fraction x documents))
    assert _document_ranges(f"{blend}-0") == {"train": set(range(32)), "valid": set(range(32, 36)),
                                               "test": set(range(36, 40))}
    assert _document_ranges(f"{blend}-1") == {"train": set(range(16)), "valid": {16, 17}, "test": {18, 19}}


@pytest.mark.slow
@pytest.mark.heavy
def test_docs_kimi_k2_path_trains_without_remote_code(dirs, tmp_path, capsys, monkeypatch, nemo):
    """docs/data.md, Kimi K2, command by command: a tiktoken directory through prepare-data, the dry run of
    kimi_k2_muon (and its refusal of a split Megatron cannot build), training (kimi_k2_proxy_muon on CPU)."""
    prepare, dryrun, launch = doc_commands("Kimi K2")
    assert prepare[:3] == ["nemo", "llm", "prepare-data"] and dryrun[-1] == "--dryrun" and launch[0] == "torchrun"
    monkeypatch.setenv("MUON_RECIPES_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken-cache"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    write_jsonl(tmp_path / "corpus" / "mixed.jsonl", stdlib_documents(12) + MULTILINGUAL * 3)
    models = {"/models/Kimi-K2-Instruct": str(dirs["kimi"])}
    assert nemo_llm([models.get(a, a) for a in prepare[2:]] + ["--quiet"]) == 0
    prefix = tmp_path / "data" / "kimi"
    # 36 documents: Megatron's bounds round(0.9 x 36) = 32, round(0.95 x 36) = 34
    assert "split     90,5,5: 32 / 2 / 2 documents (train / valid / test) of kimi\n" in capsys.readouterr().out
    base = dirs["kimi_base"]
    assert nemo_llm(dryrun[2:]) == 0
    assert (f"tokenizer   tiktoken ({base:,} + 256 special tokens, Kimi K2 rules) from {dirs['kimi']}, end of "
            f"document id {base + 1}; fits model.vocab_size 163,840") in capsys.readouterr().out
    # 98,1,1 of 36 documents: test would be [round(35.64), 36) = [36, 36), which megatron-core loops on forever
    assert nemo_llm(["pretrain", "--recipe", "kimi_k2_proxy_muon", "--yaml", "data/kimi.yaml",
                     "dataset.split='98,1,1'", "--dryrun"]) == 2
    assert capsys.readouterr().err == (
        f"error: dataset.split 98,1,1 leaves the test split of {prefix} (36 documents) empty, which Megatron cannot "
        "build; use more documents or a split with 0 for it (e.g. \"dataset.split='98,2,0'\")\n")
    result, run = _pretrain(nemo, tmp_path, _as_cpu_run(launch, "kimi_k2_proxy_muon"), "train.train_iters=10")
    losses = _losses(run)
    assert len(losses) == 10 and losses[-1] < losses[0] - 0.5, losses
    # what the run built its tokenizer from (the config it saved; megatron-bridge 0.6's build_tokenizer hands it
    # to megatron-core's, which prints no "building HuggingFaceTokenizer" line): Megatron's HuggingFaceTokenizer
    # on the converted directory (no remote code), not the Kimi one
    saved = next(run.rglob("run_config.yaml")).read_text()
    assert "tokenizer_type: HuggingFaceTokenizer" in saved
    assert f"tokenizer_model: {tmp_path / 'cache' / 'tokenizers'}/tiktoken-" in saved
