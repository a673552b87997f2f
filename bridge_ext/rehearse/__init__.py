"""Rehearse any rank of a recipe at its real layout without GPUs (``nemo llm rehearse``).

One process acts as rank R of the layout's world (e.g. 256): a fake process group of that size
(``bridge_ext.rehearse.fake``), megatron-core's parallel state with the layout's TP / PP / VP / CP / EP / ETP,
then this rank's model chunks through the recipe's own provider, Megatron's DDP and the optimizer from Megatron
Bridge's ``setup_optimizer`` (``dist_muon``: the layer-wise distributed Muon; AdamW: the distributed optimizer),
all on fake tensors (shapes and dtypes, no memory: Kimi K2's rank costs about 1 GB of RSS). One
``optimizer.step()`` runs under ``torch.utils.flop_counter.FlopCounterMode``: its matmuls are the Newton-Schulz
iterations (Adam and the momentum updates are element-wise). What the rank holds is read from those objects
(``bridge_ext.rehearse.measure``) and set beside ``nemo llm plan``'s numbers for the same rank (pipeline stage,
data-parallel and expert-data-parallel rank).

``device="cuda"`` (a GPU, Transformer Engine): the same rank with real tensors on the GPU and the recipe's own
layer spec; ``torch.cuda.max_memory_allocated`` is reported beside the objects' bytes. For recipes whose rank
fits one GPU (the Qwen3 proxies, ``qwen3_0p6b``).

``activations=True`` (the default): before the step, one micro-batch forward + backward through the rank's
chunks (``bridge_ext.rehearse.activations``: MBS and sequence length as the layout has them), its peak
activation bytes beside ``plan``'s estimate (``bridge_ext.plan.memory.activation_bytes`` for one micro-batch in
flight) and its model FLOPs (``FlopCounterMode``) beside Megatron Bridge's counter for the rank's layers
(``bridge_ext.plan.flops.model_flops_on_rank``). A model or stage that cannot run on fake tensors is reported
as not measured, with the reason.
"""

from bridge_ext.rehearse.rehearsal import Coordinates, Device, Rehearsal
from bridge_ext.rehearse.report import format_rehearsal
from bridge_ext.rehearse.run import rehearse, select_ranks, with_layout_overrides

__all__ = ["Coordinates", "Device", "Rehearsal", "format_rehearsal", "rehearse", "select_ranks",
           "with_layout_overrides"]
