"""The offline text corpus: the shipped tokenizer, the indexed dataset, the cache, ``nemo llm prepare-data``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from bridge_ext import data
from bridge_ext.data import EOD_TOKEN, PROXY_TOKENIZER_DIR, PROXY_VOCAB_SIZE
from bridge_ext.errors import UserError

SAMPLE = 'def f(x):\n    """Return x."""\n\treturn  x  .  ,  # héllo wörld 🙂 <|pad|>\r\n\n'


def nemo_llm(argv: list[str]) -> int:
    """``nemo llm ...`` through the real CLI (one ``error:`` line and exit 2 on bad input)."""
    from bridge_ext import commands

    return commands.main(["llm", *argv])


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MUON_RECIPES_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def small_corpus(monkeypatch, max_bytes: int = 600_000) -> None:
    """A ~0.6 MB corpus: the same code path, a fraction of the tokenizing time."""
    monkeypatch.setattr(data, "CORPUS_MAX_BYTES", max_bytes)


# ----------------------------------------------------------------------------------------------- tokenizer
def test_tokenizer_files_are_shipped():
    names = {p.name for p in PROXY_TOKENIZER_DIR.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "training.json"} <= names
    record = json.loads((PROXY_TOKENIZER_DIR / "training.json").read_text())
    assert record["vocab_size"] == PROXY_VOCAB_SIZE == 4096
    assert record["special_tokens"][0] == EOD_TOKEN


def test_tokenizer_round_trips_with_transformers_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(PROXY_TOKENIZER_DIR)
    assert len(tok) == 4096
    assert tok.eos_token == EOD_TOKEN and tok.eos_token_id == 0
    ids = tok(SAMPLE).input_ids
    assert tok.decode(ids) == SAMPLE  # byte-level: exact, CRLF, tabs and emoji included
    assert all(0 <= i < 4096 for i in ids)
    assert ids[-1] != tok.eos_token_id  # no special tokens added by default
    # Python code compresses: indentation and keywords are single tokens
    assert len(tok("    def __init__(self):").input_ids) <= 7
    stdlib_text = "".join(data.read_document(f) for f in data.corpus_files()[:20])
    assert len(stdlib_text) / len(tok(stdlib_text).input_ids) > 3.0  # ~3.5 bytes per token on the corpus


def test_a_tokenizer_loads_once_per_process_and_again_when_its_files_change(tmp_path):
    """load_tokenizer keeps what it loaded by directory and file contents: the same files give the same object,
    an edited tokenizer_config.json (another end-of-document token) a new one with the new id."""
    import shutil

    from bridge_ext.tokenizers import load_tokenizer

    copy = tmp_path / "tok"
    shutil.copytree(PROXY_TOKENIZER_DIR, copy)
    first = load_tokenizer(copy)
    assert load_tokenizer(copy) is first and first.eod == 0
    config = json.loads((copy / "tokenizer_config.json").read_text())
    decoder = config["added_tokens_decoder"]
    other = next(int(i) for i, t in decoder.items() if t["content"] != EOD_TOKEN)
    config["eos_token"] = decoder[str(other)]["content"]
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    changed = load_tokenizer(copy)
    assert changed is not first and changed.eod == other != 0 and first.eod == 0
    assert changed.fingerprint != first.fingerprint


def test_tokenizer_loads_through_megatron_bridge():
    from bridge_ext import patches

    patches.apply("import")
    from megatron.bridge.training.tokenizers.config import TokenizerConfig
    from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer

    tok = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer",
                                          tokenizer_model=str(PROXY_TOKENIZER_DIR)))
    assert tok.vocab_size == 4096
    assert tok.eod == 0
    assert tok.detokenize(tok.tokenize("import os\n")) == "import os\n"


def test_tokenizer_training_is_deterministic(tmp_path):
    files = data.corpus_files(max_bytes=300_000)
    first = data.train_tokenizer(tmp_path / "a", files, vocab_size=600)
    second = data.train_tokenizer(tmp_path / "b", files, vocab_size=600)
    a, b = ((d / "tokenizer.json").read_text() for d in (first, second))
    assert a == b
    assert len(json.loads(a)["model"]["vocab"]) == 600


@pytest.mark.slow
@pytest.mark.stack  # the files are written the same (and load) whichever transformers is installed
def test_shipped_tokenizer_is_what_the_training_command_gives(tmp_path):
    record = json.loads((PROXY_TOKENIZER_DIR / "training.json").read_text())
    files = data.corpus_files()
    data.train_tokenizer(tmp_path, files)
    ours, shipped = (json.loads((d / "tokenizer.json").read_text()) for d in (tmp_path, PROXY_TOKENIZER_DIR))
    if data.corpus_sha256(files) == record["corpus_sha256"]:  # the standard library it was trained on
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            assert (tmp_path / name).read_bytes() == (PROXY_TOKENIZER_DIR / name).read_bytes(), name
    else:  # another Python release: same recipe, same size and special tokens, mostly the same merges
        assert len(ours["model"]["vocab"]) == len(shipped["model"]["vocab"]) == 4096
        assert ours["added_tokens"] == shipped["added_tokens"]
        common = set(map(str, ours["model"]["merges"])) & set(map(str, shipped["model"]["merges"]))
        assert len(common) > 0.9 * len(shipped["model"]["merges"])


# -------------------------------------------------------------------------------------------------- corpus
def test_corpus_files_are_deterministic_and_exclude_tests():
    files = data.corpus_files()
    assert files == data.corpus_files()
    names = [f.name for f in files]
    assert len(names) == len(set(names)) > 100
    assert not any(part in ("test", "tests", "idle_test", "site-packages") for n in names for part in n.split("/"))
    total = sum(f.size for f in files)
    assert 5_000_000 < total <= data.CORPUS_MAX_BYTES
    assert names != sorted(names)  # a fixed mix of the library, not alphabetical
    small = data.corpus_files(max_bytes=200_000)
    assert sum(f.size for f in small) <= 200_000
    assert [f.name for f in small] == [n for n in names if n in {f.name for f in small}]  # same order


def test_corpus_builds_a_readable_indexed_dataset(tmp_cache, monkeypatch):
    small_corpus(monkeypatch)
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from transformers import AutoTokenizer

    prefix = data.prepare_text_corpus(quiet=True)
    assert Path(prefix).parent.parent == tmp_cache / "text"
    assert Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.idx").is_file()
    files = data.corpus_files()
    info = data.corpus_info(prefix)
    dataset = IndexedDataset(prefix)
    assert len(dataset) == info["documents"] == len(files)
    assert int(dataset.sequence_lengths.sum()) == info["tokens"]
    tok = AutoTokenizer.from_pretrained(PROXY_TOKENIZER_DIR)
    for index in (0, len(files) - 1):
        document = dataset[index]
        assert document[-1] == tok.eos_token_id  # EOD appended
        assert tok.eos_token_id not in document[:-1].tolist()
        assert tok.decode(document[:-1].tolist()) == files[index].path.read_bytes().decode("utf-8")
    # no temporary directories left behind
    assert [p.name for p in (tmp_cache / "text").iterdir()] == [Path(prefix).parent.name]


def test_cache_is_reused_and_force_rebuilds(tmp_cache, monkeypatch):
    small_corpus(monkeypatch, 150_000)
    prefix = data.prepare_text_corpus(quiet=True)
    stamp = os.stat(f"{prefix}.bin").st_mtime_ns
    assert data.prepare_text_corpus(quiet=True) == prefix
    assert os.stat(f"{prefix}.bin").st_mtime_ns == stamp  # not rebuilt
    assert data.prepare_text_corpus(force=True, quiet=True) == prefix
    assert os.stat(f"{prefix}.bin").st_mtime_ns != stamp
    # another corpus (here: a different cap) is another cache entry
    monkeypatch.setattr(data, "CORPUS_MAX_BYTES", 100_000)
    assert data.prepare_text_corpus(quiet=True) != prefix


@pytest.mark.slow
@pytest.mark.stack  # the split's bounds are megatron-core's (blended_megatron_dataset_config)
def test_a_blend_whose_split_leaves_one_empty_is_refused_whatever_the_tokenizer(nemo, tmp_path):
    """Issue 50: the recipe's own tokenizer and split (``9999,8,2``) on the package's prepared corpus, named as a
    plain ``dataset.blend``: megatron-core's ``GPTDataset._get_num_epochs`` spun forever on the empty test split
    (the guard ran only with ``tokenizer.tokenizer_type=HuggingFaceTokenizer``). The dry run and the run refuse it
    in one line, and the run writes nothing."""
    prefix = data.prepare_text_corpus(quiet=True)
    documents = data.corpus_info(prefix)["documents"]
    # by hand, megatron's bounds: documents [round(a N), round(b N)) for the normalized book-ends of 9999,8,2
    test_start = int(round((9999 + 8) / (9999 + 8 + 2) * documents + 1e-9))
    assert documents - test_start == 0, documents  # the premise: this corpus leaves the test split empty
    run = tmp_path / "run"
    argv = ["llm", "pretrain", "--recipe", "qwen3_proxy_muon", f'dataset.blend=[["{prefix}"],null]',
            f"checkpoint.save={run}", "train.train_iters=2"]
    want = (f"error: dataset.split 9999,8,2 leaves the test split of {prefix} ({documents} documents) empty, which "
            "Megatron cannot build; use more documents or a split with 0 for it (e.g. \"dataset.split='98,2,0'\")")
    for extra in (["--dryrun"], []):
        done = nemo([*argv, *extra], cwd=tmp_path)
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert done.code == 2 and errors == [want], (extra, done.stderr[-3000:])
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert not run.exists()


def test_use_text_corpus_sets_blend_split_and_tokenizer(tmp_cache, monkeypatch):
    small_corpus(monkeypatch, 150_000)
    from bridge_ext.build import build_config
    from recipes import get_recipe

    cfg = build_config(get_recipe("qwen3_proxy_muon"))
    assert cfg.dataset.blend is None
    line = data.use_text_corpus(cfg, quiet=True)
    prefix = data.prepare_text_corpus(quiet=True)
    assert cfg.dataset.blend == [[prefix], None]
    assert cfg.dataset.split == "98,1,1"
    assert cfg.tokenizer.tokenizer_type == "HuggingFaceTokenizer"
    assert cfg.tokenizer.tokenizer_model == str(PROXY_TOKENIZER_DIR)
    assert cfg.model.vocab_size == 4096
    assert "\n" not in line and "standard library" in line and prefix in line
    cfg.model.vocab_size = 1000
    with pytest.raises(UserError, match="vocab_size 1000"):
        data.use_text_corpus(cfg)


# ----------------------------------------------------------------------------------------------------- CLI
def test_prepare_data_command(tmp_cache, monkeypatch, capsys):
    small_corpus(monkeypatch, 150_000)
    assert nemo_llm(["prepare-data", "--quiet"]) == 0
    out = capsys.readouterr().out
    info = data.corpus_info(data.prepare_text_corpus(quiet=True))
    assert f"{info['tokens']:,} tokens" in out and "built" in out
    assert nemo_llm(["prepare-data"]) == 0
    assert "cached" in capsys.readouterr().out


def test_prepare_data_bad_input_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MUON_RECIPES_CACHE", str(tmp_path / "cache"))
    assert nemo_llm(["prepare-data", "--bogus"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unrecognized arguments: --bogus") and err.count("\n") == 1
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("MUON_RECIPES_CACHE", str(blocker / "cache"))  # under a file: cannot be created
    assert nemo_llm(["prepare-data"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot create the data cache") and err.count("\n") == 1
    monkeypatch.setenv("MUON_RECIPES_CACHE", str(tmp_path / "cache"))
    tiny_stdlib = tmp_path / "lib"
    (tiny_stdlib / "test").mkdir(parents=True)
    (tiny_stdlib / "os.py").write_text("import sys\n")
    (tiny_stdlib / "test" / "test_os.py").write_text("import os\n" * 100_000)  # test dirs do not count
    monkeypatch.setattr(data, "stdlib_dir", lambda: tiny_stdlib)
    assert nemo_llm(["prepare-data"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: the Python standard library at {tiny_stdlib} has only 11 bytes")
    assert err.count("\n") == 1
    assert not (tmp_path / "cache").exists()
    monkeypatch.setattr(data, "PROXY_TOKENIZER_DIR", tmp_path / "none")
    assert nemo_llm(["prepare-data"]) == 2
    assert capsys.readouterr().err.startswith("error: no tokenizer at")
