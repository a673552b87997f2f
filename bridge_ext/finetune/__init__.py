"""Fine-tuning (full SFT and LoRA) with Muon or AdamW on Megatron Bridge (``nemo llm finetune``).

``data`` (JSONL checks, chat-template rendering, the held-out split), ``instructions`` (the shipped
instruction set), ``build`` (the fine-tuning parts of the SFT/PEFT ``ConfigContainer``, which
``bridge_ext.build`` reads), ``lora`` (adapters merged into the base weights, then the usual HF export). The run
(checkpoint, data and Megatron Bridge's run) is ``bridge_ext.training.run_finetune``, beside pre-training's; the
command itself is ``bridge_ext.commands.finetune``. Heavy modules load lazily.
"""
