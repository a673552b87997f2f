"""Fine-tuning (full SFT and LoRA) with Muon or AdamW on Megatron Bridge: ``nemo llm finetune``.

``data`` (JSONL checks, chat-template rendering, the held-out split), ``instructions`` (the shipped
instruction set), ``build`` (recipe -> SFT/PEFT ``ConfigContainer``), ``command`` (the CLI and the run),
``lora`` (adapters merged into the base weights, then the usual HF export). Heavy modules load lazily.
"""

from __future__ import annotations

from bridge_ext.finetune.command import register

__all__ = ["register"]
