"""What conversions and training runs write, read back for the tests: every tensor of an HF directory, every
global tensor of a torch_dist checkpoint (two readers independent of ours: torch's DCP -> torch.save converter,
and DCP's own load without a process group), and comparisons byte for byte."""

from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = ["assert_bit_identical", "bits_equal", "load_safetensors", "load_torch_dist", "read_global_tensors"]


def load_safetensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in ``directory``, by name."""
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def load_torch_dist(iter_dir: Path, scratch: Path, *, tensors_only: bool = False) -> dict:
    """Every entry of a torch_dist checkpoint as global tensors / objects (torch's DCP -> torch.save converter,
    through a file in ``scratch``)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = scratch / f"{iter_dir.parent.name}-{os.getpid()}.pt"
    dcp_to_torch_save(str(iter_dir), str(target))
    state = torch.load(target, weights_only=False)
    target.unlink()
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)} if tensors_only else state


def read_global_tensors(iteration_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist checkpoint as its global tensor (any layout wrote it), by key."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(iteration_dir))
    metadata = reader.read_metadata()
    tensors = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
               for key, meta in metadata.state_dict_metadata.items() if isinstance(meta, TensorStorageMetadata)}
    dcp.load(tensors, storage_reader=reader, no_dist=True)
    return tensors


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads and signed zeros included)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.reshape(-1).view(torch.uint8).equal(
        b.reshape(-1).view(torch.uint8))


def assert_bit_identical(got: dict, want: dict, case: str) -> None:
    """The same keys; tensors bit for bit; objects (``_extra_state``, megatron-core 0.19's common state) by repr."""
    assert sorted(got) == sorted(want), (case, sorted(set(got) ^ set(want)))
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert bits_equal(got[key], value), (case, key)
        else:
            assert repr(got[key]) == repr(value), (case, key)
