"""What a checkpoint's integrity record costs (docs/checkpoints.md, "Integrity record"): one rank's data file of
GIB GiB in 32 MiB tensor chunks (what a save leaves in the page cache), in one run:

- reading it back (``os.pread`` in 8 MiB blocks, no checksum): the floor for anything that looks at the bytes;
- ``write_record`` (what every rank does after each save) and ``verify`` (export, resume);

prints the rates, their ratio to the plain read, and the seconds per save for a Kimi K2 rank at ``gb300x256``
(1.04 T parameters on 256 GPUs; a Muon checkpoint holds bf16 weights, fp32 main weights and fp32 momentum: 10 bytes
per parameter, 40.6 GB per rank; AdamW's two moments: 14 bytes, 56.9 GB).

    python bench/integrity.py [GIB]
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)

from bridge_ext.checkpoints.integrity import verify, write_record

CHUNK = 32 << 20
KIMI_PARAMS, RANKS = 1.04e12, 256


def _iteration(directory: Path, gib: float) -> int:
    """``__0_0.distcp`` of random bytes and a ``.metadata`` placing one bf16 tensor chunk per 32 MiB of it."""
    size = int(gib * (1 << 30)) // CHUNK * CHUNK
    with (directory / "__0_0.distcp").open("wb") as stream:
        for _ in range(size // CHUNK):
            stream.write(os.urandom(CHUNK))
    state, storage = {}, {}
    shape = torch.Size([CHUNK // 2])
    for i in range(size // CHUNK):
        key = f"decoder.layers.{i}.mlp.linear_fc1.weight"
        state[key] = TensorStorageMetadata(properties=TensorProperties(dtype=torch.bfloat16), size=shape,
                                           chunks=[ChunkStorageMetadata(offsets=torch.Size([0]), sizes=shape)])
        storage[MetadataIndex(key, torch.Size([0]), 0)] = _StorageInfo("__0_0.distcp", i * CHUNK, CHUNK)
    (directory / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata=state, storage_data=storage)))
    return size


def _read(path: Path) -> float:
    start = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        offset = 0
        while data := os.pread(fd, 8 << 20, offset):
            offset += len(data)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def main(gib: float = 1.0) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        size = _iteration(directory, gib)
        _read(directory / "__0_0.distcp")  # in the page cache, as right after a save
        reading = min(_read(directory / "__0_0.distcp") for _ in range(3))
        start = time.perf_counter()
        write_record(directory, rank=0, world_size=1)
        recording = time.perf_counter() - start
        start = time.perf_counter()
        verify(directory)
        verifying = time.perf_counter() - start
    rate = size / recording
    print(f"{size / 1e9:.2f} GB in {size // CHUNK} chunks, {os.cpu_count()} cores: read back {size / reading / 1e9:.2f} "
          f"GB/s; write_record {rate / 1e9:.2f} GB/s ({recording / reading:.2f}x the read); verify "
          f"{size / verifying / 1e9:.2f} GB/s ({verifying / reading:.2f}x the read)")
    for name, per_param in (("Muon", 10), ("AdamW", 14)):
        per_rank = KIMI_PARAMS * per_param / RANKS
        print(f"Kimi K2 at gb300x256, {name}: {per_rank / 1e9:.1f} GB per rank -> {per_rank / rate:.0f} s per save "
              f"at this rate (from the page cache)")


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 1.0)
