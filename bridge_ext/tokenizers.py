"""A model's own tokenizer from its directory, offline and without remote code.

Two kinds of directories:

- **Hugging Face** (Qwen3 and most models): ``tokenizer.json`` (or ``vocab.json`` + ``merges.txt``) and
  ``tokenizer_config.json``, loaded with transformers' own classes (``AutoTokenizer``,
  ``trust_remote_code=False``, local files only); batches are encoded by its Rust backend.
- **tiktoken** (Kimi K2): ``tiktoken.model`` (base64 token, rank per line) and ``tokenizer_config.json``,
  whose ``auto_map`` points at the repository's ``tokenization_kimi.py``. That code is never run: the
  vocabulary is loaded into a ``tiktoken.Encoding`` with the rules that file states (its ``pat_str``, 256
  reserved special tokens after the base vocabulary named by ``added_tokens_decoder``, ``[BOS]`` /
  ``[EOS]`` defaults, special-token text allowed, long texts cut at 400,000 characters and runs of more
  than 25,000 whitespace or non-whitespace characters). For Megatron Bridge, which builds tokenizers
  from a ``TokenizerConfig`` (``megatron.bridge.training.tokenizers``: ``HuggingFaceTokenizer`` loads
  ``AutoTokenizer`` from ``tokenizer_model``), the same vocabulary is converted once with transformers'
  ``TikTokenConverter`` into a Hugging Face directory in the cache (:func:`megatron_tokenizer_dir`);
  ``pretrain`` then uses the same ids (tested: equal to a direct ``tiktoken`` encode).

``end of document`` is the tokenizer's ``eos_token``, as Megatron Bridge's ``HuggingFaceTokenizer.eod``.
Public API: :func:`load_tokenizer`, :class:`TextTokenizer`, :func:`megatron_tokenizer_dir`,
:func:`use_megatron_tokenizer`, :func:`check_tokenizer_fits`, :data:`KIMI_PAT_STR`.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from bridge_ext.errors import UserError
from bridge_ext.runtime import rename_into_place
from bridge_ext.stack import UpstreamDrift, signature_params, version_of

__all__ = ["KIMI_PAT_STR", "KIMI_RESERVED_SPECIAL_TOKENS", "TextTokenizer", "TokenizerKind", "check_tokenizer_fits",
           "load_tokenizer", "megatron_tokenizer_dir", "tiktoken_converter", "tokenizer_problem",
           "use_megatron_tokenizer"]

TokenizerKind = Literal["huggingface", "tiktoken"]

# tokenization_kimi.py (moonshotai/Kimi-K2-Instruct): TikTokenTokenizer.pat_str, num_reserved_special_tokens,
# and the two limits of its encode() (tiktoken issue #195).
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
KIMI_RESERVED_SPECIAL_TOKENS = 256
_TIKTOKEN_MAX_ENCODE_CHARS = 400_000
_MAX_NO_WHITESPACES_CHARS = 25_000
_LONG_SPACE = re.compile(r"\s{%d}" % (_MAX_NO_WHITESPACES_CHARS + 1))

# Files whose bytes define a tokenizer (hashed into every dataset key made with it).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "vocab.json", "merges.txt", "tokenizer.model", "tiktoken.model")
_CONVERTED_FORMAT = 1  # bump when the converted directory's layout changes


@dataclass(frozen=True)  # shared: load_tokenizer keeps one per process
class TextTokenizer:
    """A loaded tokenizer: ``encode_batch`` (no BOS/EOS added), ``decode``, its size and end-of-document id."""

    directory: Path
    kind: TokenizerKind
    vocab_size: int  # every id it can produce is below this (Megatron Bridge's tokenizer.vocab_size)
    eod: int | None  # the eos_token's id
    fingerprint: str  # SHA-256 over its files
    description: str
    _backend: Any = field(repr=False, default=None)
    _hf: Any = field(repr=False, default=None)

    def encode_batch(self, texts: list[str], *, threads: int = 1) -> list[list[int]]:
        """Ids of each text as the model's tokenizer gives them (special-token text maps to its id)."""
        if self.kind == "huggingface":
            return [e.ids for e in self._backend.encode_batch_fast(texts, add_special_tokens=False)]
        pieces, owners = [], []
        for index, text in enumerate(texts):
            for piece in _kimi_pieces(text):
                pieces.append(piece)
                owners.append(index)
        if len(pieces) == len(texts):
            return self._backend.encode_batch(texts, num_threads=threads, allowed_special="all")
        out: list[list[int]] = [[] for _ in texts]
        for owner, ids in zip(owners, self._backend.encode_batch(pieces, num_threads=threads, allowed_special="all")):
            out[owner].extend(ids)
        return out

    def encode_batch_numpy(self, texts: list[str], *, threads: int = 1) -> list[Any]:
        """:meth:`encode_batch` as uint32 numpy arrays (tiktoken writes them without Python lists)."""
        import numpy as np

        if self.kind == "huggingface":
            return [np.array(e.ids, dtype=np.uint32) for e in self._backend.encode_batch_fast(texts,
                                                                                               add_special_tokens=False)]
        pieces, owners = [], []
        for index, text in enumerate(texts):
            for piece in _kimi_pieces(text):
                pieces.append(piece)
                owners.append(index)
        encode = functools.partial(self._backend.encode_to_numpy, allowed_special="all")
        if threads > 1:
            with ThreadPoolExecutor(threads) as pool:  # tiktoken's Rust core releases the GIL
                arrays = list(pool.map(encode, pieces))
        else:
            arrays = list(map(encode, pieces))
        if len(pieces) == len(texts):
            return arrays
        grouped: list[list[Any]] = [[] for _ in texts]
        for owner, array in zip(owners, arrays):
            grouped[owner].append(array)
        return [np.concatenate(parts) if len(parts) > 1 else parts[0] for parts in grouped]

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def decode(self, ids: list[int]) -> str:
        if self.kind == "huggingface":
            return self._hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return self._backend.decode(ids)


def _has_long_run(text: str) -> bool:
    """A run of more than 25,000 whitespace or non-whitespace characters (``str.isspace``, as Kimi's code)."""
    return (max(map(len, text.split()), default=0) > _MAX_NO_WHITESPACES_CHARS
            or _LONG_SPACE.search(text) is not None)


def _kimi_pieces(text: str) -> list[str]:
    """tokenization_kimi.py's encode(): 400,000-character chunks, runs of at most 25,000 (non-)whitespace."""
    if len(text) <= _MAX_NO_WHITESPACES_CHARS or (len(text) <= _TIKTOKEN_MAX_ENCODE_CHARS
                                                   and not _has_long_run(text)):
        return [text]
    out = []
    for start in range(0, len(text), _TIKTOKEN_MAX_ENCODE_CHARS):
        out.extend(_split_runs(text[start:start + _TIKTOKEN_MAX_ENCODE_CHARS], _MAX_NO_WHITESPACES_CHARS))
    return out


def _split_runs(s: str, limit: int) -> list[str]:
    """Cut ``s`` so that no piece has more than ``limit`` consecutive whitespace or non-whitespace characters."""
    if not _has_long_run(s):
        return [s]
    out, run, is_space, start = [], 0, s[0].isspace() if s else False, 0
    for i, char in enumerate(s):
        now = char.isspace()
        if is_space ^ now:
            run, is_space = 1, now
        else:
            run += 1
            if run > limit:
                out.append(s[start:i])
                start, run = i, 1
    out.append(s[start:])
    return out


# ------------------------------------------------------------------------------------------------- loading
def _fingerprint(directory: Path, kind: str) -> str:
    digest = hashlib.sha256(f"kind={kind}\n".encode())
    for name in _TOKENIZER_FILES:
        path = directory / name
        if path.is_file():
            digest.update(f"{name}\0".encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def _kind(directory: Path) -> TokenizerKind:
    if not directory.is_dir():
        what = "is a file, not a directory" if directory.exists() else "does not exist"
        raise UserError(f"tokenizer directory {directory} {what}; pass the model's directory (with tokenizer.json "
                        "or tiktoken.model) to --tokenizer")
    if (directory / "tokenizer.json").is_file() or ((directory / "vocab.json").is_file()
                                                    and (directory / "merges.txt").is_file()):
        return "huggingface"
    if (directory / "tiktoken.model").is_file():
        return "tiktoken"
    raise UserError(f"no tokenizer files in {directory} (need tokenizer.json, vocab.json + merges.txt, or "
                    "tiktoken.model + tokenizer_config.json); copy them from the model's directory")


def _token_text(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is not valid JSON ({exc}); restore it from the model's directory") from None


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """A ``tiktoken.model`` file's ranks, parsed as ``tiktoken.load.load_tiktoken_bpe`` does.

    Read directly: ``load_tiktoken_bpe`` caches files by *path* in a temporary directory, so a changed
    file at the same path would be read stale.
    """
    from tiktoken.load import read_file

    ranks = {}
    try:
        for number, line in enumerate(read_file(str(path)).splitlines(), 1):
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    except ValueError:
        raise UserError(f"{path} line {number} is not `<base64 token> <rank>`; restore the model's "
                        "tiktoken.model") from None
    return ranks


def _tiktoken_specials(directory: Path, ranks: dict[bytes, int]) -> tuple[dict[str, int], dict[str, Any]]:
    """Kimi's special tokens: ids base .. base + 255, named by ``added_tokens_decoder`` or ``<|reserved_token_i|>``."""
    config = _read_config(directory)
    base = len(ranks)
    if sorted(ranks.values()) != list(range(base)):
        raise UserError(f"{directory / 'tiktoken.model'} does not hold ranks 0..{base - 1}; restore the model's file")
    named = {int(i): _token_text(v) for i, v in (config.get("added_tokens_decoder") or {}).items()}
    if any(i < base for i in named):
        raise UserError(f"{directory / 'tokenizer_config.json'}: added_tokens_decoder ids must follow the "
                        f"{base} tiktoken ranks")
    count = max([KIMI_RESERVED_SPECIAL_TOKENS, *(i - base + 1 for i in named)])
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + count)}
    if len(specials) != count:
        raise UserError(f"{directory / 'tokenizer_config.json'}: two special tokens have the same text")
    return specials, config


def load_tokenizer(directory: str | Path) -> TextTokenizer:
    """The tokenizer in a model directory (Hugging Face or tiktoken files), offline, no remote code.

    Loaded once per process for the same files (a run's checks ask for it several times; a Hugging Face
    tokenizer takes ~15 ms to load): kept by directory and the SHA-256 of its files, so changed files load anew.
    """
    directory = Path(directory).expanduser().resolve()
    kind = _kind(directory)
    fingerprint = _fingerprint(directory, kind)
    key = (directory, fingerprint)
    if key not in _LOADED:
        _LOADED[key] = _load(directory, kind, fingerprint)
    return _LOADED[key]


_LOADED: dict[tuple[Path, str], TextTokenizer] = {}


def _load(directory: Path, kind: TokenizerKind, fingerprint: str) -> TextTokenizer:
    if kind == "huggingface":
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False, local_files_only=True,
                                               use_fast=True)
        except Exception as exc:  # transformers raises ValueError, OSError, KeyError ... for unusable files
            needs_code = "auto_map" in _read_config(directory)
            hint = ("it needs the repository's remote code, which this package never runs"
                    if needs_code else f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}")
            raise UserError(f"cannot load the tokenizer in {directory} with transformers ({hint})") from None
        if not getattr(hf, "is_fast", False):
            raise UserError(f"the tokenizer in {directory} has no fast (tokenizer.json) form; save it with "
                            "transformers' AutoTokenizer(...).save_pretrained first")
        name = type(hf).__name__
        return TextTokenizer(directory, kind, len(hf), hf.eos_token_id, fingerprint,
                             f"{name} ({len(hf):,} tokens)", _backend=hf.backend_tokenizer, _hf=hf)
    import tiktoken

    ranks = read_tiktoken_ranks(directory / "tiktoken.model")
    specials, config = _tiktoken_specials(directory, ranks)
    encoding = tiktoken.Encoding(name=f"{directory.name}/tiktoken.model", pat_str=KIMI_PAT_STR,
                                 mergeable_ranks=ranks, special_tokens=specials)
    eos = _token_text(config.get("eos_token")) or "[EOS]"  # tokenization_kimi.py's default
    if eos not in specials:
        raise UserError(f"the eos_token {eos!r} of {directory / 'tokenizer_config.json'} is not one of its "
                        "special tokens (added_tokens_decoder)")
    return TextTokenizer(directory, kind, encoding.n_vocab, specials[eos], fingerprint,
                         f"tiktoken ({len(ranks):,} + {len(specials)} special tokens, Kimi K2 rules)",
                         _backend=encoding)


# ------------------------------------------------------------------------------------------ Megatron Bridge
class _NoTiktokenCache:
    """``tiktoken.load`` copies every file it reads into ``$TMP/data-gym-cache`` (keyed by path) unless the
    cache directory is set to ``""``; the converter below reads a file whose path is content-keyed already."""

    def __enter__(self):
        self.saved = os.environ.get("TIKTOKEN_CACHE_DIR")
        os.environ["TIKTOKEN_CACHE_DIR"] = ""

    def __exit__(self, *exc):
        if self.saved is None:
            os.environ.pop("TIKTOKEN_CACHE_DIR", None)
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = self.saved


def megatron_tokenizer_dir(directory: str | Path, *, quiet: bool = True) -> Path:
    """A directory Megatron Bridge's ``HuggingFaceTokenizer`` loads with the same ids as :func:`load_tokenizer`.

    A Hugging Face directory is returned as it is. A tiktoken one is converted once (transformers'
    ``TikTokenConverter`` with Kimi's pattern, its special tokens added in id order) into
    ``<cache>/tokenizers/tiktoken-<hash>/`` (``tokenizer.json``, ``tokenizer_config.json``, the copied
    ``tiktoken.model``), written to a temporary directory and renamed into place.
    """
    tok = load_tokenizer(directory)
    if tok.kind == "huggingface":
        return tok.directory
    from bridge_ext.cache import cache_root

    parent = cache_root() / "tokenizers"
    final = parent / f"tiktoken-{tok.fingerprint[:16]}-v{_CONVERTED_FORMAT}"
    if (final / "tokenizer.json").is_file():
        return final
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create the tokenizer cache {parent} ({exc.strerror}); set $MUON_RECIPES_CACHE") from None
    tmp = parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _write_converted(tok, tmp)
        rename_into_place(tmp, final, marker="tokenizer.json")  # or another rank's identical conversion
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _write_converted(tok: TextTokenizer, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    shutil.copyfile(tok.directory / "tiktoken.model", out / "tiktoken.model")
    encoding = tok._backend
    specials = sorted(encoding._special_tokens.items(), key=lambda item: item[1])
    with _NoTiktokenCache():
        backend = tiktoken_converter(vocab_file=str(out / "tiktoken.model"), pattern=KIMI_PAT_STR,
                                     special_tokens=[name for name, _ in specials]).converted()
    config = _read_config(tok.directory)
    names = {key: _token_text(config.get(key)) for key in ("bos_token", "eos_token", "unk_token", "pad_token")}
    names["bos_token"] = names["bos_token"] or "[BOS]"
    names["eos_token"] = names["eos_token"] or "[EOS]"
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False,
                                   model_max_length=1 << 30, **{k: v for k, v in names.items() if v})
    fast.save_pretrained(str(out))
    (out / "converted_from.json").write_text(json.dumps({
        "source": str(tok.directory), "fingerprint": tok.fingerprint, "pattern": "Kimi K2 (tokenization_kimi.py)",
        "special_tokens": len(specials), "vocab_size": tok.vocab_size}, indent=1) + "\n")
    check = len(fast)
    if check != tok.vocab_size:  # the conversion must keep every id where tiktoken has it
        raise UserError(f"converting {tok.directory} gave {check} tokens, tiktoken has {tok.vocab_size}")


def _configured_dir(cfg: Any) -> Path | None:
    tok = cfg.tokenizer
    if tok.tokenizer_type != "HuggingFaceTokenizer" or not tok.tokenizer_model:
        return None
    return Path(str(tok.tokenizer_model)).expanduser()


def tokenizer_problem(cfg: Any) -> str | None:
    """Why the configured tokenizer cannot train this model (``None`` when it can): a missing directory, or
    more tokens than the model's vocabulary (``model.vocab_size``, which Megatron Bridge does not pad when
    set; unset, it is padded from the tokenizer's size and always fits)."""
    directory = _configured_dir(cfg)
    if directory is None:
        return None
    if not directory.is_dir():
        return (f"tokenizer.tokenizer_model {directory} is not a directory; copy the model's tokenizer files "
                "there (this package never downloads)")
    try:
        tok = load_tokenizer(directory)
    except UserError as exc:
        return str(exc)
    model_vocab = getattr(cfg.model, "vocab_size", None)
    if model_vocab is not None and tok.vocab_size > model_vocab:
        return (f"the tokenizer in {directory} has {tok.vocab_size:,} tokens but model.vocab_size is "
                f"{model_vocab:,}: its ids would not fit the embedding; use the model's own tokenizer "
                "(or a model with a larger vocabulary)")
    return None


def check_tokenizer_fits(cfg: Any) -> str | None:
    """Raise :class:`UserError` when :func:`tokenizer_problem` finds one; else a one-line description (or None)."""
    problem = tokenizer_problem(cfg)
    if problem:
        raise UserError(problem)
    directory = _configured_dir(cfg)
    if directory is None:
        return None
    tok = load_tokenizer(directory)
    vocab = getattr(cfg.model, "vocab_size", None)
    room = f"fits model.vocab_size {vocab:,}" if vocab else "model vocabulary padded from it"
    return f"{tok.description} from {tok.directory}, end of document id {tok.eod}; {room}"


def use_megatron_tokenizer(cfg: Any, *, quiet: bool = True) -> None:
    """Point ``cfg.tokenizer`` at a directory Megatron Bridge loads without remote code (see
    :func:`megatron_tokenizer_dir`); checks the fit first. Nothing changes for other tokenizer types."""
    check_tokenizer_fits(cfg)
    directory = _configured_dir(cfg)
    if directory is None:
        return
    cfg.tokenizer.tokenizer_model = str(megatron_tokenizer_dir(directory, quiet=quiet))
    cfg.tokenizer.vocab_size = None
    kwargs = dict(cfg.tokenizer.hf_tokenizer_kwargs or {})
    kwargs.setdefault("use_fast", True)  # the tokenizer.json prepare-data encoded with (megatron-core: slow)
    kwargs["trust_remote_code"] = False
    cfg.tokenizer.hf_tokenizer_kwargs = kwargs


def tiktoken_converter(*, vocab_file: str, pattern: str, special_tokens: list[str]) -> Any:
    """transformers' ``convert_slow_tokenizer.TikTokenConverter`` for ``vocab_file`` with ``special_tokens`` added
    after its ranks, in that order.

    Its keyword for them is ``additional_special_tokens`` in transformers 4 and ``extra_special_tokens`` in 5
    (5.3 on); the constructor takes ``**kwargs``, so the other name is accepted and dropped without a word (a
    Kimi K2 conversion then lost its 256 special tokens). The name is read from the installed signature."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    params = signature_params(TikTokenConverter.__init__)
    keyword = next((name for name in ("extra_special_tokens", "additional_special_tokens") if name in params), None)
    if keyword is None:
        raise UpstreamDrift(f"transformers {version_of('transformers')}: TikTokenConverter takes neither "
                            "extra_special_tokens nor additional_special_tokens; bridge_ext's tiktoken_converter "
                            "needs its new keyword for this release")
    return TikTokenConverter(vocab_file=vocab_file, pattern=pattern, **{keyword: list(special_tokens)})
