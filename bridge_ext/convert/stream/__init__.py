"""Streaming conversion: Hugging Face safetensors <-> Megatron torch_dist, tensor by tensor, in bounded memory.

The mappings are Megatron Bridge's own (the model's bridge's ``MegatronMappingRegistry``, through
``build_conversion_tasks``, as ``AutoBridge`` converts); the Megatron side is a meta-device skeleton of the model
(:mod:`~bridge_ext.convert.stream.skeleton`: names, shapes, module types, checkpoint keys and chunks, no storage);
torch_dist files are written chunk by chunk (:mod:`~bridge_ext.convert.stream.torch_dist`) and read region by region
(:mod:`bridge_ext.checkpoints.torch_dist`), HF shards
by byte range (:mod:`~bridge_ext.convert.stream.hf_io`). :mod:`~bridge_ext.convert.stream.importer` (HF ->
torch_dist) and :mod:`~bridge_ext.convert.stream.exporter` (torch_dist -> HF).
"""

from __future__ import annotations

from bridge_ext.checkpoints.torch_dist import missing_stored_file
from bridge_ext.convert.stream.exporter import export_streaming_into
from bridge_ext.convert.stream.importer import DEFAULT_THREADS, import_streaming
from bridge_ext.convert.stream.skeleton import NeedsModel

__all__ = ["DEFAULT_THREADS", "NeedsModel", "export_streaming_into", "import_streaming", "missing_stored_file"]
