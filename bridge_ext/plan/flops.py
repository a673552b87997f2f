"""Model FLOPs per step from Megatron Bridge's own counter, without importing torch or Megatron.

``megatron.bridge.training.utils.flop_utils.num_floating_point_operations(cfg, batch_size)`` is what makes
the TFLOP/s that Megatron Bridge logs (and NVIDIA's benchmark reports). Importing that module imports torch,
Megatron Bridge's config and its PEFT code (27 s on a shared 2-core machine; ``import_cost_s`` measures
it), so ``nemo llm plan`` runs the installed function's own source instead: the function is read from the
installed file, compiled with its module-level names bound to plain stand-ins (``F.silu`` a marker,
``LoRA`` a class no config is an instance of, ``calculate_padded_vocab_size`` compiled the same way from
``megatron/bridge/utils/vocab_utils.py``), and called on a ``cfg.model`` holding the provider fields the
counter reads, mirrored from the model's ``recipes.architecture.Architecture`` (its HF ``config.json``) as
AutoBridge maps them (:func:`provider_fields`).
``tests/test_plan.py`` checks both against the imported module on the real ``ConfigContainer``.
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
import time
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

from bridge_ext.stack import UpstreamDrift, package_of
from recipes.architecture import Architecture

__all__ = ["FLOP_UTILS", "flop_counter", "import_cost_s", "model_flops_on_rank", "model_flops_per_step",
           "provider_fields"]

FLOP_UTILS = "megatron.bridge.training.utils.flop_utils"
_VOCAB_UTILS = "megatron.bridge.utils.vocab_utils"
SILU = SimpleNamespace(name="silu")  # stands for torch.nn.functional.silu in the counter's comparison


class _NoLoRA:
    """Stands for ``megatron.bridge.peft.lora.LoRA``: pre-training configs have no PEFT."""


class _Unreached:
    """Stands for a name only other kinds of run reach (megatron-bridge 0.6: hybrid Mamba layer patterns, vision
    encoders, packed LoRA data); the GPT pre-training configs the counter gets here never do."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise UpstreamDrift(f"flop_utils reached {self._name}, which a GPT pre-training config never does")

    def __getattr__(self, attribute: str) -> Any:
        raise UpstreamDrift(f"flop_utils reached {self._name}.{attribute}, which a GPT pre-training config never does")


def _module_file(module: str) -> Path:
    """The installed file of ``module`` without importing it (or its packages' ``__init__``)."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)  # `megatron` is a namespace package: importing it runs nothing
    if spec is None or not spec.submodule_search_locations:
        raise UpstreamDrift(f"{package_of(module)}: {module} is not installed; `nemo llm plan` needs it for FLOPs")
    for root in spec.submodule_search_locations:
        path = Path(root, *rest).with_suffix(".py")
        if path.is_file():
            return path
    raise UpstreamDrift(f"{package_of(module)}: {module} not found; `nemo llm plan` reads its FLOP counter")


def _functions(module: str, names: tuple[str, ...], namespace: dict[str, Any]) -> dict[str, Callable]:
    """Compile the top-level functions ``names`` of ``module``'s installed source into ``namespace``.

    Decorators are dropped (``lru_cache`` only). Every global name the functions read must be in
    ``namespace`` or be a builtin or one of the compiled functions: otherwise the upstream code changed
    and :class:`UpstreamDrift` says so.
    """
    path = _module_file(module)
    tree = ast.parse(path.read_text(), filename=str(path))
    found = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names}
    # megatron-bridge 0.6's utils/vocab_utils.py re-exports megatron-core 0.19's megatron/training/vocab_utils.py
    moved = {node.module for node in tree.body if isinstance(node, ast.ImportFrom) and node.level == 0
             and {alias.name for alias in node.names if alias.asname is None} >= set(names)}
    if not found and len(moved) == 1:
        return _functions(moved.pop(), names, namespace)
    if set(found) != set(names):
        raise UpstreamDrift(f"{package_of(module)}: {module} no longer defines {sorted(set(names) - set(found))}; "
                            "bridge_ext.plan.flops needs updating for this release")
    for node in found.values():
        node.decorator_list = []
    free = {n.id for node in found.values() for n in ast.walk(node) if isinstance(n, ast.Name)
            and isinstance(n.ctx, ast.Load)}
    local = {a.arg for node in found.values() for a in ast.walk(node) if isinstance(a, ast.arg)}
    local |= {n.id for node in found.values() for n in ast.walk(node) if isinstance(n, ast.Name)
              and isinstance(n.ctx, ast.Store)}
    local |= {n.name for node in found.values() for n in ast.walk(node) if isinstance(n, ast.FunctionDef)}
    unknown = sorted(free - local - set(namespace) - set(names) - set(dir(builtins)))
    if unknown:
        raise UpstreamDrift(f"{package_of(module)}: {module}'s {', '.join(names)} now read {unknown}; "
                            "bridge_ext.plan.flops needs updating for this release")
    code = compile(ast.Module(body=list(found.values()), type_ignores=[]), str(path), "exec")
    exec(code, namespace)  # noqa: S102 - the installed Megatron Bridge's own source
    return {name: namespace[name] for name in names}


@cache
def flop_counter() -> Callable[[Any, int], float]:
    """The installed ``num_floating_point_operations(cfg, batch_size)``, compiled without torch."""
    import math
    from functools import lru_cache

    vocab = _functions(_VOCAB_UTILS, ("calculate_padded_vocab_size", "_calculate_padded_vocab_size_cached"),
                       {"math": math, "lru_cache": lru_cache, "print_rank_0": lambda *a, **k: None})

    def _no_packed_stats(*args: Any, **kwargs: Any) -> Any:  # LoRA + packed SQuAD only
        raise UpstreamDrift("flop_utils asked for packed-sequence statistics, which pre-training never has")

    namespace = {"F": SimpleNamespace(silu=SILU), "LoRA": _NoLoRA, "ConfigContainer": object, "Path": Path,
                 "calculate_padded_vocab_size": vocab["calculate_padded_vocab_size"],
                 "calculate_avg_seqlen": _no_packed_stats, "_lora_seq_stats_cache": {},
                 **{name: _Unreached(name) for name in ("Symbols", "get_hybrid_layer_counts", "parse_hybrid_pattern",
                                                        "vit_flops", "_packed_data_exists",
                                                        "importlib")}}  # 0.4-0.5: hybrid patterns only
    return _functions(FLOP_UTILS, ("num_floating_point_operations",), namespace)["num_floating_point_operations"]


def provider_fields(arch: Architecture, *, seq_length: int, tp: int) -> dict[str, Any]:
    """The provider fields the FLOP counter reads, as AutoBridge maps an HF config (Qwen3, Qwen3-MoE,
    DeepSeek-V3 / Kimi K2); ``tests/test_plan.py`` compares them with the provider AutoBridge builds."""
    moe, mla = arch.moe, arch.mla
    fields: dict[str, Any] = {
        "num_layers": arch.num_layers, "hidden_size": arch.hidden_size, "num_attention_heads": arch.num_attention_heads,
        "num_query_groups": arch.num_kv_heads, "ffn_hidden_size": arch.ffn_hidden_size,
        "kv_channels": arch.head_dim, "vocab_size": arch.vocab_size,
        "make_vocab_size_divisible_by": _vocab_divisor(arch.vocab_size), "tensor_model_parallel_size": tp,
        "seq_length": seq_length,
        "gated_linear_unit": True, "activation_func": SILU, "num_moe_experts": moe.experts if moe else None,
        "moe_ffn_hidden_size": moe.ffn_hidden_size if moe else None,
        "moe_router_topk": moe.top_k if moe else 2,
        "moe_shared_expert_intermediate_size": None, "mtp_num_layers": None, "multi_latent_attention": mla is not None,
        "moe_layer_freq": 1,
    }
    if mla is not None:
        # megatron/bridge/models/deepseek/deepseek_v3_bridge.py: [0] * first_k_dense_replace + [1] * the rest
        fields.update(make_vocab_size_divisible_by=1280, q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank,
                      qk_head_dim=mla.qk_nope_head_dim, qk_pos_emb_head_dim=mla.qk_rope_head_dim,
                      v_head_dim=mla.v_head_dim,
                      moe_layer_freq=[int(arch.is_moe(layer)) for layer in range(arch.num_layers)])
    if moe and moe.shared_experts:
        fields["moe_shared_expert_intermediate_size"] = moe.shared_ffn_hidden_size
    # num_nextn_predict_layers: AutoBridge does not build MTP layers for pre-training by default (mtp_num_layers None)
    return fields


def _vocab_divisor(vocab_size: int) -> int:
    """``MegatronModelBridge.make_vocab_size_divisible_by``: the largest power of 2 up to 128 dividing it."""
    base = 128
    while vocab_size % base:
        base //= 2
    return base


def model_flops_per_step(arch: Architecture, *, seq_length: int, tp: int, global_batch_size: int) -> float:
    """Megatron Bridge's model FLOPs for one optimizer step (``global_batch_size`` sequences)."""
    cfg = SimpleNamespace(model=SimpleNamespace(**provider_fields(arch, seq_length=seq_length, tp=tp)),
                          peft=None, dataset=None)
    return float(flop_counter()(cfg, global_batch_size))


def _counted(fields: dict[str, Any], sequences: int) -> float:
    return float(flop_counter()(SimpleNamespace(model=SimpleNamespace(**fields), peft=None, dataset=None), sequences))


def model_flops_on_rank(arch: Architecture, *, layers: tuple[int, ...], logits: bool, seq_length: int, tp: int,
                        cp: int = 1, micro_batch_size: int = 1) -> float:
    """Megatron Bridge's model FLOPs for one micro-batch on one rank: the counter's terms for the decoder
    ``layers`` the rank holds (and the logits when it holds the output layer), over TP x CP. Attention, dense
    MLPs, shared experts and the output layer: each TP rank computes its shard of every GEMM on all of the
    micro-batch's tokens. Routed experts too: the rank enters the MoE layer with its sequence-parallel 1/TP of
    the tokens, the ``allgather`` dispatcher gathers the expert-tensor x expert-parallel group's (ETP x EP,
    megatron-core's ``tp_ep`` group), and the rank's ``experts / EP`` experts at 1/ETP of their width see
    ``tokens / TP x ETP x top-k`` in all under a balanced load: 1/TP of the routed GEMMs, whatever ETP.

    The counter is linear in the layers: with ``F(L)`` its count for the layer list ``L``, the logits are
    ``2 F(L) - F(L + L)``. Like the counter this omits the router GEMM and counts causal attention as half
    the ``s x s`` products."""
    if not layers and not logits:
        return 0.0
    fields = provider_fields(arch, seq_length=seq_length, tp=tp)
    pattern = list(layers) or [0]
    moe = [int(arch.is_moe(layer)) for layer in pattern] if arch.moe else None

    def count(copies: int) -> float:
        patch: dict[str, Any] = {"num_layers": copies * len(pattern)}
        if moe is not None:
            patch["moe_layer_freq"] = moe * copies
        return _counted({**fields, **patch}, micro_batch_size)

    once, twice = count(1), count(2)
    logit_flops = 2 * once - twice
    layer_flops = once - logit_flops if layers else 0.0
    return (layer_flops + (logit_flops if logits else 0.0)) / (tp * cp)


def import_cost_s() -> float:
    """Seconds to import the FLOP counter the ordinary way (torch + Megatron Bridge), in this process."""
    start = time.perf_counter()
    importlib.import_module(FLOP_UTILS)
    return time.perf_counter() - start
