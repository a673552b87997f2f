"""What vetting a checkpoint's pickles costs at the real layout's size (docs/checkpoints.md, "Checkpoints from
someone else"): a torch DCP ``.metadata`` with one entry per tensor for TENSORS tensors (Kimi K2's experts and
optimizer states on 256 GPUs: ~200,000), vetted (``bridge_ext.checkpoints.pickles.vet_pickle``) and loaded with
the plain ``pickle.load`` Megatron's loader uses, in one run; prints both times and their ratio.

    python bench/vet_checkpoint.py [TENSORS]
"""

from __future__ import annotations

import pickle
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)

from bridge_ext.checkpoints.pickles import vet_pickle


def main(tensors: int = 200_000) -> None:
    size = torch.Size([7168, 2048])
    state, storage = {}, {}
    for i in range(tensors):
        key = f"decoder.layers.{i % 61}.mlp.experts.local_experts.{i % 384}.linear_fc{i % 2 + 1}.weight.{i}"
        state[key] = TensorStorageMetadata(properties=TensorProperties(dtype=torch.bfloat16), size=size,
                                           chunks=[ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=size)])
        storage[MetadataIndex(key, torch.Size([0, 0]), 0)] = _StorageInfo(
            relative_path=f"__{i % 256}_0.distcp", offset=i * 4096, length=size.numel() * 2)
    data = pickle.dumps(Metadata(state_dict_metadata=state, storage_data=storage))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / ".metadata"
        path.write_bytes(data)
        start = time.perf_counter()
        vet_pickle(path)
        vetting = time.perf_counter() - start
        start = time.perf_counter()
        with path.open("rb") as f:
            pickle.load(f)
        loading = time.perf_counter() - start
    print(f"{tensors} tensors, .metadata {len(data) / 1e6:.1f} MB: vetting {vetting:.2f} s, plain pickle.load "
          f"{loading:.2f} s, ratio {vetting / loading:.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200_000)
