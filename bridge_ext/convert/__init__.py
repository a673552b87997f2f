"""``nemo llm import`` / ``nemo llm export``: Hugging Face <-> Megatron checkpoints, safely and verified.

Built on Megatron Bridge's ``AutoBridge`` (``megatron/bridge/models/conversion/auto_bridge.py``, 0.3.1) and
its per-model mappings; what this module adds:

* Validation before any work: directory, ``config.json``, supported architecture, safetensors headers and
  sizes (truncation), every shard the index lists, every tensor the architecture needs (names and shapes,
  from a meta-device transformers model), dtypes. Each problem is one :class:`UserError` line.
* Safety: output goes to a temporary directory beside the target and is renamed into place only when the
  conversion (and ``--verify``) succeeded; a non-empty target is refused without ``--overwrite``; inputs
  are only read.
* Kimi K2 (``model_type: kimi_k2`` + ``auto_map`` into remote code) without remote code: the config is
  built by :func:`bridge_ext.hf.load_hf_config`; the import keeps the source's ``config.json`` bytes and
  tokenizer/generation files next to the checkpoint (``hf_source/``) so an export reproduces them exactly.
* Strict weight accounting: Megatron Bridge skips a parameter with a warning when no mapping matches
  (``model_bridge.py:1205-1226``); here every Megatron parameter must be loaded and every HF tensor of the
  architecture must be written, or the conversion fails.
* Streaming export: shards are planned from the architecture's tensor list and each tensor is written at
  its offset as it arrives, so an export holds the model plus one tensor.
* ``--verify``: the written checkpoint is loaded into an fp32 Megatron model and compared with the
  transformers model on the same tokens; the largest logit difference is reported and checked.
* Export of training runs: latest complete ``iter_*`` or ``--iteration N``; the HF config is found from the
  import's ``hf_source/``, the run's ``hf_model_id`` or the matching shipped recipe config; optimizer state
  is never read; weights load without Megatron Core's gate/up merge copies.
* Kimi K2 / DeepSeek-V3 fp8 releases (e4m3 + 128x128 ``weight_scale_inv``) are dequantized on import; so is
  Kimi-K2-Thinking's int4 (compressed-tensors ``pack-quantized``, :mod:`~bridge_ext.hf.int4`).


Parts: :mod:`~bridge_ext.convert.megatron_ckpt` (finding and reading Megatron checkpoints),
:mod:`~bridge_ext.convert.staging` (staged, atomic output), :mod:`~bridge_ext.convert.parallel` (process group
and parallel state), :mod:`~bridge_ext.convert.model` (building the Megatron side; SequentialMLP experts in
Megatron Bridge's mappings: ``bridge_ext.patches.conversion``),
:mod:`~bridge_ext.convert.verify`, :mod:`~bridge_ext.convert.hf_to_megatron` (import), :mod:`~bridge_ext.convert.megatron_to_hf` (export), :mod:`~bridge_ext.convert.report` (summary and
progress) and :mod:`~bridge_ext.convert.cli` (the commands on the console; their options:
``bridge_ext.commands.hf_import`` / ``hf_export``). Reading and validating HF directories (and their fp8 /
int4 releases) is :mod:`bridge_ext.hf`; this package re-exports the names the commands use.
"""

from __future__ import annotations

from bridge_ext.convert.cli import run_export, run_import
from bridge_ext.convert.hf_to_megatron import import_hf
from bridge_ext.convert.megatron_ckpt import find_iteration
from bridge_ext.convert.megatron_to_hf import DEFAULT_SHARD_BYTES, export_hf
from bridge_ext.convert.report import ConversionSummary
from bridge_ext.convert.verify import VERIFY_TOLERANCE, verify_logits
from bridge_ext.hf.directory import (
    HF_SOURCE_DIR,
    HFSource,
    inspect_hf_dir,
    read_safetensors_header,
    supported_architectures,
)
from bridge_ext.hf.fp8 import dequantize_fp8

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "HF_SOURCE_DIR",
    "VERIFY_TOLERANCE",
    "ConversionSummary",
    "HFSource",
    "dequantize_fp8",
    "export_hf",
    "find_iteration",
    "import_hf",
    "inspect_hf_dir",
    "read_safetensors_header",
    "run_export",
    "run_import",
    "supported_architectures",
    "verify_logits",
]
