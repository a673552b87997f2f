"""After training: text from a checkpoint (``nemo llm generate``) and the pieces ``nemo llm evaluate`` shares.

* :mod:`~bridge_ext.inference.model`: a saved Megatron checkpoint as a model on this machine, built from the
  iteration's own ``run_config.yaml`` (the run's model provider) after :func:`bridge_ext.checkpoints.find_iteration`
  (pickles vetted) and :func:`bridge_ext.checkpoints.integrity.verify` (``scope="model"``); its tokenizer; a
  Hugging Face directory through transformers.
* :mod:`~bridge_ext.inference.generate`: one decoding loop (greedy, or temperature / top-k / top-p sampling with a
  seed) over either model, streaming to the console or writing JSONL.

Why not megatron-core's inference engine here: docs/evaluate.md ("generate"). Imports nothing heavy at module level.
"""
