"""A Hugging Face directory from someone else is checked before any large allocation (issue 37, part 3).

Each damage is planted in a copy of a tiny Qwen3 directory (safetensors headers rewritten byte by byte, sizes in
``config.json``, NaN / Inf in the data, links and FIFOs); the expected message names what was planted. Every
damage case runs through ``nemo llm import`` in this process: exit 2, one line naming the file (and the tensor),
nothing at ``--out``. A legitimate directory laid out as the hub cache writes it (symlinks into ``blobs/``, a
``pytorch_model.bin`` pickle beside the safetensors that must never be read) still imports and verifies.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import shutil
import signal
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

import hf_fixtures
from bridge_ext.errors import UserError
from bridge_ext.hf import untrusted
from bridge_ext.hf.directory import inspect_hf_dir, read_safetensors_header
from bridge_ext.hf.untrusted import MAX_HEADER_BYTES, check_finite, check_model_fits

pytestmark = pytest.mark.stack  # the checks met through transformers and the commands; `once`: our parser alone


# ------------------------------------------------------------------------------------------------- planting
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """Tiny fp32 Qwen3 in several shards with an index (the planted data's source)."""
    return hf_fixtures.qwen3_dir(tmp_path_factory.mktemp("src") / "qwen3", shard_bytes=100_000)


@pytest.fixture
def hf(tiny, tmp_path) -> Path:
    return Path(shutil.copytree(tiny, tmp_path / "hf"))


def shard_of(hf: Path, tensor: str) -> Path:
    return hf / json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"][tensor]


def header_of(shard: Path) -> tuple[int, dict]:
    data = shard.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return length, json.loads(data[8 : 8 + length])


def rewrite_header(shard: Path, change: Callable[[dict], None]) -> None:
    """``change`` the header dict in place; the data section stays byte for byte."""
    data = shard.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    change(header)
    new = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(new)) + new + data[8 + length :])


def set_config(hf: Path, **values) -> Path:
    config = hf / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **values}))
    return config


def plant_value(hf: Path, tensor: str, element: int, value: float) -> None:
    """Write ``value`` (fp32) at ``element`` of ``tensor`` in its shard."""
    shard = shard_of(hf, tensor)
    length, header = header_of(shard)
    with open(shard, "r+b") as handle:
        handle.seek(8 + length + header[tensor]["data_offsets"][0] + 4 * element)
        handle.write(struct.pack("<f", value))


def refused(hf: Path, *needles: str) -> str:
    with pytest.raises(UserError) as info:
        inspect_hf_dir(hf)
    message = str(info.value)
    assert "\n" not in message and message, message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


DOWN = "model.layers.1.mlp.down_proj.weight"  # [64, 128] fp32
UP = "model.layers.1.mlp.up_proj.weight"  # [128, 64]: as many bytes as DOWN


# ------------------------------------------------------------------------------------------------- headers
@pytest.mark.once  # our parser on planted bytes: the same on every stack
def test_header_length_past_the_file_is_refused_unread(hf):
    shard = shard_of(hf, DOWN)
    with open(shard, "r+b") as handle:
        handle.write(struct.pack("<Q", shard.stat().st_size))  # one more than the file can hold
    refused(hf, shard.name, f"header length {shard.stat().st_size:,}")


@pytest.mark.once  # our parser on planted bytes: the same on every stack
def test_header_length_meant_to_exhaust_memory_is_refused_before_reading(tmp_path):
    """A sparse file larger than the cap whose header claims cap + 1 bytes: refused from the 8-byte prefix."""
    shard = tmp_path / "model.safetensors"
    with open(shard, "wb") as handle:
        handle.write(struct.pack("<Q", MAX_HEADER_BYTES + 1))
        handle.truncate(2 * MAX_HEADER_BYTES)  # sparse: no disk, no page cache
    with pytest.raises(UserError, match=f"header length {MAX_HEADER_BYTES + 1:,}.*refused unread") as info:
        read_safetensors_header(shard)
    assert "model.safetensors" in str(info.value)


@pytest.mark.once  # our parser on planted bytes: the same on every stack
def test_tensor_past_the_end_of_the_file(hf):
    shard = shard_of(hf, DOWN)
    length, header = header_of(shard)
    data_len = shard.stat().st_size - 8 - length
    nbytes = 64 * 128 * 4
    rewrite_header(shard, lambda h: h[DOWN].update(data_offsets=[data_len, data_len + nbytes]))
    refused(hf, shard.name, f"tensor {DOWN} ends at byte {data_len + nbytes:,}", "truncated")


@pytest.mark.once  # our parser on planted bytes: the same on every stack
def test_overlapping_tensors(hf):
    shard = shard_of(hf, DOWN)
    assert shard_of(hf, UP) == shard
    _, header = header_of(shard)
    first, second = sorted([UP, DOWN], key=lambda n: header[n]["data_offsets"][0])
    # the later tensor is pointed at the earlier one's bytes (same size: the shape check passes)
    rewrite_header(shard, lambda h: h[second].update(data_offsets=list(header[first]["data_offsets"])))
    refused(hf, shard.name, f"tensors {first} and {second} overlap")


@pytest.mark.once  # our parser on planted bytes: the same on every stack
def test_bytes_that_belong_to_no_tensor(hf):
    shard = shard_of(hf, DOWN)
    rewrite_header(shard, lambda h: h.pop(DOWN))
    refused(hf, shard.name, "belong to no tensor")


@pytest.mark.parametrize("entry", [
    {"shape": [64, -128]}, {"shape": [64.0, 128]}, {"shape": [True, 128]}, {"data_offsets": [10, 2]},
    {"data_offsets": ["0", 32768]}, {"data_offsets": [0]},
])  # fmt: skip
@pytest.mark.once  # our parser on planted bytes: the same on every stack
def test_malformed_entries(hf, entry):
    shard = shard_of(hf, DOWN)
    rewrite_header(shard, lambda h: h[DOWN].update(entry))
    refused(hf, shard.name, DOWN)


@pytest.mark.once  # our parser on planted bytes: the same on every stack
def test_header_that_is_not_json_deep_nesting(hf):
    shard = shard_of(hf, DOWN)
    data = shard.read_bytes()
    bomb = b"[" * 200_000
    shard.write_bytes(struct.pack("<Q", len(bomb)) + bomb + data)
    refused(hf, shard.name, "not valid JSON")


@pytest.mark.parametrize("dtype, message", [("I64", "weights must be floating point"),
                                            ("BOOL", None), ("STR", "which conversion cannot take")])
@pytest.mark.once  # our parser on planted bytes: the same on every stack
def test_dtypes_the_model_cannot_take(hf, dtype, message):
    shard = shard_of(hf, DOWN)
    itemsize = {"I64": 8, "BOOL": 1, "STR": 4}[dtype]
    shape = [64 * 128 * 4 // itemsize]  # same bytes, so the header is consistent
    rewrite_header(shard, lambda h: h[DOWN].update(dtype=dtype, shape=shape))
    text = refused(hf, DOWN, dtype)
    assert message is None or message in text


# ------------------------------------------------------------------------------------------------- index, links
@pytest.mark.once  # our parser on planted bytes: the same on every stack
def test_index_naming_a_file_outside_the_directory(hf):
    index = hf / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    raw["weight_map"][DOWN] = "../elsewhere.safetensors"
    index.write_text(json.dumps(raw))
    refused(hf, "model.safetensors.index.json", "'../elsewhere.safetensors'")


@pytest.mark.once  # our parser on planted bytes: the same on every stack
def test_index_putting_a_tensor_in_the_wrong_shard(hf):
    index = hf / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    other = next(f for f in sorted(set(raw["weight_map"].values())) if f != raw["weight_map"][DOWN])
    raw["weight_map"][DOWN] = other
    index.write_text(json.dumps(raw))
    refused(hf, f"puts {DOWN} in {other}")


@pytest.mark.once  # our parser on planted bytes: the same on every stack
def test_fifo_and_broken_link_shards_are_refused_without_blocking(hf):
    shard = shard_of(hf, DOWN)
    shard.unlink()
    os.mkfifo(shard)  # opening it would block forever: fail instead of hanging if it ever is opened
    previous = signal.signal(signal.SIGALRM, lambda *_: pytest.fail("opened the FIFO"))
    signal.alarm(30)
    try:
        refused(hf, shard.name, "not a regular file")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    shard.unlink()
    shard.symlink_to(hf / "gone" / "blob")
    refused(hf, shard.name)


def hub_cache(source: Path, root: Path) -> Path:
    """``source`` laid out as huggingface_hub's cache: ``snapshots/<rev>/<name> -> ../../blobs/<sha256>``."""
    blobs, snapshot = root / "blobs", root / "snapshots" / ("ab" * 20)
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(source.iterdir()):
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blobs / digest)
        (snapshot / file.name).symlink_to(Path("..") / ".." / "blobs" / digest)
    return snapshot


def test_hub_cache_symlinks_pass(tiny, tmp_path):
    snapshot = hub_cache(tiny, tmp_path / "models--x--tiny")
    assert all(p.is_symlink() for p in snapshot.iterdir())
    source = inspect_hf_dir(snapshot)
    assert source.tensors == inspect_hf_dir(tiny).tensors and len(source.tensors) == 25


# ------------------------------------------------------------------------------------------------- config.json
@pytest.mark.parametrize("key, value, needle", [
    ("vocab_size", 10**9, "vocab_size is 1,000,000,000, over the 100,000,000"),
    ("hidden_size", 10**9, "hidden_size is 1,000,000,000, over"),
    ("num_hidden_layers", -2, "num_hidden_layers is -2"),
    ("intermediate_size", 128.5, "intermediate_size is 128.5"),
    ("num_attention_heads", "4", "num_attention_heads is '4'"),
    ("num_hidden_layers", 0, "num_hidden_layers is 0"),
])  # fmt: skip
def test_absurd_config_sizes_are_refused_before_transformers(hf, monkeypatch, key, value, needle):
    monkeypatch.setattr("bridge_ext.hf.config.load_hf_config", _must_not_run)
    set_config(hf, **{key: value})
    refused(hf, "config.json", needle)


def _must_not_run(*args, **kwargs):
    raise AssertionError("built from a config that should have been refused")


def test_config_larger_than_its_weights_is_refused_before_the_meta_model(tiny, hf, monkeypatch):
    """Under every cap, but 10^7 x 64 embeddings are not in the 0.4 MB of files."""
    stored = sum(math.prod(t.shape) * 4 for t in inspect_hf_dir(tiny).tensors.values())
    monkeypatch.setattr("bridge_ext.hf.directory.model_tensor_shapes", _must_not_run)
    set_config(hf, vocab_size=10_000_000)
    message = refused(hf, "config.json", "vocab_size 10,000,000", "the sizes do not match the weights")
    assert f"safetensors hold {stored / 1e3:.2f} KB" in message, message


@pytest.mark.once  # our parser on planted bytes: the same on every stack
def test_config_json_over_the_size_cap_is_refused_unread(hf):
    config = hf / "config.json"
    with open(config, "r+b") as handle:
        handle.truncate(untrusted.MAX_JSON_BYTES + 1)  # sparse tail of zero bytes
    refused(hf, "config.json", f"{untrusted.MAX_JSON_BYTES + 1:,} bytes", "refused unread")


def test_model_building_paths_must_fit_the_machine(tiny, tmp_path, monkeypatch):
    source = inspect_hf_dir(tiny)
    parameters = sum(math.prod(t.shape) for t in source.tensors.values())
    assert source.parameters == parameters  # the estimate is exact for this config
    with pytest.raises(UserError, match=f"needs at least {parameters * 4 / 1e3:.2f} KB, this machine has 1.00 KB"):
        check_model_fits(parameters=parameters, bytes_per_param=4, processes=1, what="x", hint="h",
                         where=tiny / "config.json", memory=1000)  # fmt: skip
    check_model_fits(parameters=parameters, bytes_per_param=4, processes=4, what="x", hint="h",
                     where=tiny / "config.json", memory=parameters)  # a quarter each fits
    from bridge_ext.convert import import_hf

    monkeypatch.setattr(untrusted, "machine_memory_bytes", lambda: 1000)
    with pytest.raises(UserError, match="--verify's fp32 model needs at least .*import without --verify"):
        import_hf(tiny, tmp_path / "out", verify=True, progress=False, console=None)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_no_stream_must_fit_the_machine(tiny, tmp_path, monkeypatch, cpu_mode):
    from bridge_ext.convert import import_hf

    monkeypatch.setattr(untrusted, "machine_memory_bytes", lambda: 1000)
    with pytest.raises(UserError, match=r"the model-building conversion \(--no-stream, --tp/--pp/--ep\) needs at "
                                        r"least .*, this machine has 1.00 KB of memory; stream it"):
        import_hf(tiny, tmp_path / "new" / "out", stream=False, progress=False, console=None)
    assert not (tmp_path / "new").exists()


# ------------------------------------------------------------------------------------------------- NaN / Inf
@pytest.mark.once  # our parser on planted bytes: the same on every stack
def test_check_finite_names_the_tensor_and_the_first_bad_element():
    import torch

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        weights = torch.randn(300, 7).to(dtype)
        check_finite(weights, name="w", file=Path("f.safetensors"))
        for value, kind in ((float("nan"), "NaN"), (float("inf"), "Inf"), (float("-inf"), "Inf")):
            planted = weights.clone()
            planted[123, 4] = value
            planted[200, 0] = float("nan")  # a later one: the first is reported
            with pytest.raises(UserError, match=rf"f.safetensors: tensor w has {kind} at element {123 * 7 + 4:,} "
                                                rf"of 2,100 \(shape \[300, 7\]\)"):
                check_finite(planted, name="w", file=Path("f.safetensors"))
    big = torch.full((4, 30_000), 60_000.0, dtype=torch.float16)  # finite; its fp16 sum overflows
    check_finite(big, name="big", file=Path("f"))
    check_finite(torch.tensor([1, 2], dtype=torch.int64), name="ints", file=Path("f"))


# ------------------------------------------------------------------------------------------------- the command
DAMAGES: dict[str, Callable[[Path], str]] = {}


def damage(name: str):
    def register(plant: Callable[[Path], str]):
        DAMAGES[name] = plant
        return plant

    return register


@damage("header length")
def _(hf: Path) -> str:
    shard = shard_of(hf, DOWN)
    with open(shard, "r+b") as handle:
        handle.write(struct.pack("<Q", 2**62))
    return shard.name


@damage("overlap")
def _(hf: Path) -> str:
    shard = shard_of(hf, DOWN)
    _, header = header_of(shard)
    first, second = sorted([UP, DOWN], key=lambda n: header[n]["data_offsets"][0])
    rewrite_header(shard, lambda h: h[second].update(data_offsets=list(header[first]["data_offsets"])))
    return second


@damage("vocab 10^9")
def _(hf: Path) -> str:
    set_config(hf, vocab_size=10**9)
    return "config.json"


@damage("dtype")
def _(hf: Path) -> str:
    rewrite_header(shard_of(hf, DOWN), lambda h: h[DOWN].update(dtype="I64", shape=[64 * 128 // 2]))
    return DOWN


@damage("nan")
def _(hf: Path) -> str:
    plant_value(hf, DOWN, 1000, float("nan"))
    return f"{shard_of(hf, DOWN).name}: tensor {DOWN} has NaN at element 1,000"


def assert_refused(result, needle: str, out: Path) -> None:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.code == 2, (result.code, result.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr
    assert not out.parent.exists()  # nothing written: not even the parent --out would have been made in


@pytest.mark.parametrize("name", [n for n in DAMAGES if n != "nan"])
def test_import_refuses_each_damage_in_one_line(hf, tmp_path, nemo, name):
    needle = DAMAGES[name](hf)
    out = tmp_path / "new" / "ckpt"
    assert_refused(nemo(["llm", "import", "--hf", hf, "--out", out]), needle, out)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "no-stream"])
def test_import_refuses_nan_weights_naming_file_and_tensor(hf, tmp_path, nemo, cpu_mode, stream):
    needle = DAMAGES["nan"](hf)
    out = tmp_path / "new" / "ckpt"
    assert_refused(nemo(["llm", "import", "--hf", hf, "--out", out, *([] if stream else ["--no-stream"])]),
                   needle, out)  # fmt: skip


class Planted:
    """Unpickled, it creates its marker file (what a real attack would do with os.system)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.slow
def test_hub_cache_directory_imports_and_verifies_without_reading_the_pickle(tiny, tmp_path, nemo, cpu_mode):
    snapshot = hub_cache(tiny, tmp_path / "models--x--tiny")
    marker = tmp_path / "PICKLE_RAN"
    (snapshot / "pytorch_model.bin").write_bytes(pickle.dumps(Planted(marker)))
    out = tmp_path / "ckpt"
    result = nemo(["llm", "import", "--hf", snapshot, "--out", out, "--verify", "--tolerance", "1e-5"])
    assert result.code == 0, result.stderr[-3000:]
    assert "import: 25 tensors" in result.stdout and "verified: max |logit diff|" in result.stdout, result.stdout
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == "0"
    assert not marker.exists()
