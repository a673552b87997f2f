"""The parameters each rank builds under TP / PP / VP / EP / ETP, from the HF config alone (no torch).

Starts from the routing manifest's parameter list (``bridge_ext.muon.muon_plan``: Megatron's names,
shapes, layers, experts and the optimizer megatron-core routes each to) and applies megatron-core 0.16's
sharding rules:

- column-parallel linears (``linear_qkv``, ``linear_q_proj``, ``linear_q_up_proj``, ``linear_kv_up_proj``,
  dense and shared-expert ``linear_fc1``) split their output rows over TP; row-parallel linears
  (``linear_proj``, dense and shared-expert ``linear_fc2``) their input columns; the word embedding and an
  untied output layer split the vocabulary;
- MLA's ``linear_q_down_proj`` / ``linear_kv_down_proj`` are ``TELinear(parallel_mode="duplicated")`` in the
  Transformer Engine spec (whole on every TP rank) and ``ColumnParallelLinear`` in the local spec that CPU
  runs use (``multi_latent_attention.py``: ``q_down_proj_kwargs``; ``gpt_layer_specs.py``);
- norms, the router and ``linear_proj.bias`` are replicated;
- routed experts: ``num_experts / EP`` per rank, each split over ETP like a dense MLP;
- pipeline: decoder layers per stage from the layout string (``recipes.layouts.pipeline_stages``) or an even
  split; virtual stage ``i`` lives on pipeline rank ``i % PP``; the embedding on the first stage, the final
  norm and output layer on the last; tied embeddings with PP > 1 put a copy of the word embedding on the
  last stage as its output layer (``LanguageModule.setup_embeddings_and_output_layer``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from recipes.architecture import Architecture
from recipes.layouts import Layout, pipeline_stages

__all__ = ["Spec", "Tensor", "RankParams", "rank_params"]

Spec = Literal["te", "local"]  # Transformer Engine layer spec (GPUs) or megatron-core's local spec (CPU)

_COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_q_proj.weight", "linear_q_up_proj.weight",
           "linear_kv_up_proj.weight", "linear_fc1.weight")
_ROW = ("linear_proj.weight", "linear_fc2.weight")
_DOWN = ("linear_q_down_proj.weight", "linear_kv_down_proj.weight")
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass(frozen=True)
class Tensor:
    name: str
    numel: int  # on this rank
    route: Literal["muon", "adam"]  # where a Muon optimizer sends it (AdamW: every tensor to Adam)
    expert: bool  # a routed expert's weight: reduced and sharded over the expert-data-parallel group
    # Newton-Schulz FLOPs of one Muon step on this rank's shard (the manifest's per copy over the TP split; 0 for
    # Adam's). Blockwise TP: each rank orthogonalizes its own shard; a replicated matrix is orthogonalized whole
    # on every TP rank.
    ns_flops: int = 0


@dataclass(frozen=True)
class RankParams:
    """What one pipeline rank builds (every TP / EP rank of a stage builds the same count)."""

    pp_rank: int
    layers: tuple[int, ...]
    tensors: tuple[Tensor, ...]

    @property
    def total(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def expert(self) -> int:
        return sum(t.numel for t in self.tensors if t.expert)

    @property
    def dense(self) -> int:
        return self.total - self.expert

    def routed(self, route: str) -> int:
        return sum(t.numel for t in self.tensors if t.route == route)


def _stages(layout: Layout, num_layers: int) -> list[dict[str, Any]]:
    """Per virtual stage (in pipeline order): its decoder layers and whether it has the embedding / loss."""
    count = layout.pp * (layout.vp or 1)
    if layout.pipeline_layout:
        strings = pipeline_stages(layout.pipeline_layout)
    else:
        per = num_layers // count
        strings = ["t" * per for _ in range(count)]
        strings[0] = "E" + strings[0]
        strings[-1] += "L"
    out, next_layer = [], 0
    for text in strings:
        n = text.count("t")
        out.append({"layers": list(range(next_layer, next_layer + n)), "embedding": "E" in text, "loss": "L" in text})
        next_layer += n
    return out


def _numel(name: str, shape: tuple[int, ...], *, tp: int, etp: int, spec: Spec, expert: bool) -> int:
    numel = math.prod(shape)
    if expert:
        return numel // etp if name.endswith(("linear_fc1.weight", "linear_fc2.weight")) else numel
    if name.endswith(_COLUMN) or name.endswith(_ROW) or name in _VOCAB:
        return numel // tp
    if name.endswith(_DOWN):
        return numel if spec == "te" else numel // tp
    return numel  # norms, router, linear_proj.bias: replicated


def _ns_per_rank(row: Any, numel: int) -> int:
    """One copy's Newton-Schulz FLOPs on a rank holding ``numel`` of it, 1/split of the row's work: blockwise
    mode's blocks are the TP shards, equal in size; duplicated mode's work is TP whole matrices, one per rank."""
    if not row.ns_flops:
        return 0
    split = math.prod(row.shape) // numel
    return row.ns_flops // row.copies // split


def rank_params(arch: Architecture, rows: Any, layout: Layout, *, spec: Spec = "te",
                tied: bool | None = None) -> list[RankParams]:
    """Per pipeline rank, the tensors it holds (``rows``: ``MuonPlan.rows`` of the recipe's model)."""
    tied = arch.tie_word_embeddings if tied is None else tied
    stages = _stages(layout, arch.num_layers)
    pp, experts_per_rank = layout.pp, None
    per_rank: list[list[Tensor]] = [[] for _ in range(pp)]
    layers_of: list[list[int]] = [[] for _ in range(pp)]
    rank_of_layer = {}
    for index, stage in enumerate(stages):
        rank = index % pp
        layers_of[rank] += stage["layers"]
        rank_of_layer.update({layer: rank for layer in stage["layers"]})
    first = next(i for i, s in enumerate(stages) if s["embedding"]) % pp
    last = next(i for i, s in enumerate(stages) if s["loss"]) % pp
    for row in rows:
        name, shape, route = row.pattern, tuple(row.shape), row.route
        if row.experts:
            experts_per_rank = row.experts // layout.ep
        if row.layers is None:
            ranks = {"embedding.word_embeddings.weight": [first], "output_layer.weight": [last],
                     "decoder.final_layernorm.weight": [last]}[name]
            numel = _numel(name, shape, tp=layout.tp, etp=layout.etp, spec=spec, expert=False)
            for rank in ranks:
                per_rank[rank].append(Tensor(name, numel, route, False, _ns_per_rank(row, numel)))
            continue
        numel = _numel(name, shape, tp=layout.tp, etp=layout.etp, spec=spec, expert=bool(row.experts))
        ns = _ns_per_rank(row, numel)
        for layer in row.layers:
            rank = rank_of_layer[layer]
            copies = experts_per_rank if row.experts else 1
            for expert in range(copies):
                per_rank[rank].append(Tensor(name.format(layer=layer, expert=expert), numel, route, bool(row.experts),
                                             ns))
    if tied and pp > 1:  # the last stage's output layer is a copy of the word embedding
        embedding = next(t for t in per_rank[first] if t.name == "embedding.word_embeddings.weight")
        per_rank[last].append(Tensor("output_layer.weight", embedding.numel, embedding.route, False,
                                     embedding.ns_flops))
    return [RankParams(pp_rank=r, layers=tuple(layers_of[r]), tensors=tuple(per_rank[r])) for r in range(pp)]
