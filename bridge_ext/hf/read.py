"""Reading a validated HF directory's tensors by name, routed experts per expert whatever the layout on disk."""

from __future__ import annotations

from typing import Any

from bridge_ext.hf.directory import HFSource
from bridge_ext.hf.fp8 import dequantize_fp8
from bridge_ext.hf.int4 import read_int4

__all__ = ["HFTensorReader", "per_expert_state"]


class _Names(list):
    """A list of names (what Megatron Bridge's ``get_all_keys`` returns) with set-speed ``in``."""

    def __init__(self, names: list[str]):
        super().__init__(names)
        self._set = frozenset(names)

    def __contains__(self, name: object) -> bool:
        return name in self._set


class HFTensorReader:
    """Tensors of ``source`` by stored name or, for fused checkpoints, by per-expert name (one expert's rows
    are read from the fused tensor, never the whole of it). ``dequantize``: fp8 weights with block scales come
    back as bf16 (:func:`~bridge_ext.hf.fp8.dequantize_fp8`); int4 weights always come back dequantized
(:mod:`~bridge_ext.hf.int4`)."""

    def __init__(self, source: HFSource, *, dequantize: bool = False):
        self.source = source
        self.dequantize = dequantize and source.fp8
        self._names = _Names(source.readable())
        self._handles: dict[str, Any] = {}

    def names(self) -> list[str]:
        return self._names

    def has(self, name: str) -> bool:
        return name in self._names

    def _handle(self, file: str) -> Any:
        from safetensors import safe_open

        if file not in self._handles:
            self._handles[file] = safe_open(str(self.source.path / file), "pt")
        return self._handles[file]

    def read(self, name: str) -> Any:
        """The tensor ``name``; KeyError when the checkpoint has no such tensor."""
        import torch

        view = self.source.expert_views.get(name)
        if view is not None:
            part = self._handle(self.source.tensors[view.fused].file).get_slice(view.fused)
            rows = view.rows or (0, self.source.tensors[view.fused].shape[1])
            return part[view.expert : view.expert + 1, rows[0] : rows[1]][0].contiguous()
        if name not in self._names:
            raise KeyError(name)
        if name in self.source.int4_weights:  # dequantized always: no int4 tensor goes on under a weight's name
            return read_int4(name, self._stored, self.source.int4, getattr(torch, self.source.dtype))
        tensor = self._stored(name)
        scale = self.source.tensors.get(f"{name}_scale_inv")
        if self.dequantize and scale is not None and tensor.element_size() == 1:
            scale_inv = self._handle(scale.file).get_tensor(f"{name}_scale_inv")
            tensor = dequantize_fp8(tensor, scale_inv, self.source.fp8_block)
        return tensor

    def _stored(self, name: str) -> Any:
        return self._handle(self.source.tensors[name].file).get_tensor(name)

    def close(self) -> None:
        self._handles.clear()  # safe_open handles close when released


def per_expert_state(source: HFSource) -> Any:
    """A Megatron Bridge ``StateDict`` over ``source`` with routed experts per expert, the names its mappings use
    (``hf_pretrained/state.py``: a ``StateSource`` gives ``get_all_keys`` and ``load_tensors``)."""
    from megatron.bridge.models.hf_pretrained.state import StateDict, StateSource

    reader = HFTensorReader(source)

    class PerExpertSource(StateSource):
        def get_all_keys(self) -> list[str]:
            return reader.names()

        def load_tensors(self, keys: list[str]) -> dict[str, Any]:
            return {key: reader.read(key) for key in keys if reader.has(key)}

    return StateDict(PerExpertSource())
