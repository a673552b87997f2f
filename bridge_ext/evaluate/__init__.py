"""``nemo llm evaluate``: held-out loss and perplexity of saved checkpoints (:mod:`.held_out`, by Megatron Bridge's
own evaluation), on the data :mod:`.data` resolves; and multiple-choice accuracy as lm-evaluation-harness scores it
(:mod:`.choices`, ``--choices``). :mod:`.iterations` picks the iterations both evaluate.

Before anything loads: :func:`bridge_ext.checkpoints.find_iteration` (pickles vetted) and
:func:`bridge_ext.checkpoints.integrity.verify` with ``scope="model"``, for every iteration.
"""

from bridge_ext.evaluate.choices import ChoiceRecord, Scored, encode_pair, read_choices, run_choices, score_choices
from bridge_ext.evaluate.held_out import Evaluated, evaluate_checkpoint, run_evaluate, write_csv, write_plot
from bridge_ext.evaluate.iterations import select_iterations

__all__ = ["ChoiceRecord", "Evaluated", "Scored", "encode_pair", "evaluate_checkpoint", "read_choices",
           "run_choices", "run_evaluate", "score_choices", "select_iterations", "write_csv", "write_plot"]
