"""Tiny random Hugging Face checkpoints built with transformers, for conversion and training tests.

Every builder writes a complete HF directory (``config.json`` + safetensors, sharded with an index when
``shard_bytes`` is given) and returns its path. Weights are random but deterministic (``seed``); norms are
around 1, the DeepSeek-V3 expert-score bias is non-zero so that tests see it. Nothing is downloaded.

Built with the installed transformers, 4 or 5. Routed experts are written as released checkpoints hold them,
one tensor per expert (transformers 5's ``save_pretrained`` writes its fused experts back that way), with
the same values under both: random values are drawn per expert name. ``expert_layout="fused"`` writes the
transformers 5 fused layout (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]):
by transformers itself where ``save_pretrained`` offers ``save_original_format``, else stacked here.

* :func:`qwen3_dir` — dense Qwen3 (GQA, QK-norm), ``Qwen3ForCausalLM``; :func:`qwen3_tied_dir` the same in
  bf16 with tied embeddings (like Qwen3-0.6B/1.7B/4B).
* :func:`qwen3_moe_dir` — Qwen3-MoE (softmax router, top-k, no shared expert), ``Qwen3MoeForCausalLM``.
* :func:`kimi_k2_dir` — Kimi-K2-style DeepSeek-V3: MLA, sigmoid router with expert bias, a shared expert,
  one dense first layer, YaRN rope; its ``config.json`` is the real Kimi K2 one (``model_type: kimi_k2``,
  ``auto_map`` into remote code, every key) with only the sizes shrunk.
"""

from __future__ import annotations

import inspect
import json
import re
import shutil
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "KIMI_K2_CONFIG",
    "QWEN3_TINY",
    "QWEN3_MOE_TINY",
    "KIMI_K2_TINY_SIZES",
    "kimi_k2_dir",
    "kimi_k2_fp8_dir",
    "kimi_k2_thinking_int4_dir",
    "int4_representable",
    "pack_int4",
    "quantize_fp8",
    "qwen3_dir",
    "qwen3_moe_dir",
    "qwen3_tied_dir",
    "randomize_",
    "write_hf_dir",
    "write_tokenizer",
]

REPO = Path(__file__).resolve().parents[1]
KIMI_K2_CONFIG = REPO / "recipes" / "hf_configs" / "kimi_k2" / "config.json"

QWEN3_TINY: dict[str, Any] = dict(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    attention_bias=False,
    hidden_act="silu",
    bos_token_id=1,
    eos_token_id=2,
)

QWEN3_MOE_TINY: dict[str, Any] = dict(
    QWEN3_TINY,
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
    router_aux_loss_coef=0.001,
    output_router_logits=False,
)

# Only sizes change; every other key and value is the real Kimi K2 config's.
KIMI_K2_TINY_SIZES: dict[str, Any] = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    bos_token_id=1,
    eos_token_id=2,
)


# transformers 5's fused routed experts (modeling_qwen3_moe.py / modeling_deepseek_v3.py: gate_up_proj [E, 2I, H]
# with expert N's gate rows first, down_proj [E, H, I]).
_FUSED_EXPERTS = re.compile(r"^(.+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def _per_expert_targets(tensors: dict) -> dict:
    """name -> tensor to fill, routed experts under their released per-expert names (views into fused ones)."""
    out = {}
    for name, tensor in tensors.items():
        match = _FUSED_EXPERTS.match(name)
        if match is None:
            out[name] = tensor
            continue
        for n in range(tensor.shape[0]):
            if match[2] == "down_proj":
                out[f"{match[1]}.{n}.down_proj.weight"] = tensor[n]
            else:
                half = tensor.shape[1] // 2
                out[f"{match[1]}.{n}.gate_proj.weight"] = tensor[n, :half]
                out[f"{match[1]}.{n}.up_proj.weight"] = tensor[n, half:]
    return out


def randomize_(model, *, seed: int) -> None:
    """Overwrite every parameter and floating buffer with deterministic random values.

    transformers initializes some tensors to constants (norms to 1, the expert-score bias to 0); a
    conversion that dropped or swapped them would go unnoticed with those values. Values are drawn per
    released tensor name (routed experts one by one), so a model gets the same values under transformers 4
    (per-expert modules) and 5 (fused experts).
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        tensors = dict(model.named_parameters())
        tensors.update({n: b for n, b in model.named_buffers() if b.is_floating_point() and "inv_freq" not in n})
        tensors = _per_expert_targets(tensors)
        for name in sorted(tensors):
            t = tensors[name]
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight") or "layernorm" in name:
                t.copy_(1.0 + 0.1 * noise)
            elif "e_score_correction_bias" in name:
                t.copy_(0.1 * noise)
            else:
                t.copy_(0.05 * noise)


def write_hf_dir(
    out: str | Path,
    config: dict[str, Any],
    *,
    seed: int = 0,
    dtype: str = "float32",
    shard_bytes: int | None = None,
    config_json: dict[str, Any] | None = None,
    expert_layout: Literal["per_expert", "fused"] = "per_expert",
) -> Path:
    """Build a random model for ``config`` and save it to ``out`` as a HF directory.

    ``config_json``, when given, is written verbatim as ``config.json`` instead of transformers' own
    serialization (used for configs transformers does not know, such as ``model_type: kimi_k2``).
    ``expert_layout``: routed experts as released checkpoints store them, or fused as transformers 5 can save.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from bridge_ext.hf import load_hf_config

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    raw = dict(config, torch_dtype=dtype)
    (out / "config.json").write_text(json.dumps(config_json or raw, indent=2) + "\n")
    hf_config = load_hf_config(out)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)  # `dtype`: transformers >= 4.56
    randomize_(model, seed=seed)
    model = model.to(getattr(torch, dtype))
    kwargs = {"max_shard_size": shard_bytes} if shard_bytes else {}
    if expert_layout == "fused":
        if "save_original_format" in inspect.signature(model.save_pretrained).parameters:
            model.save_pretrained(out, save_original_format=False, **kwargs)  # the model's own (fused) names
        else:
            _save_fused(model, out, shard_bytes=shard_bytes)
    else:
        model.save_pretrained(out, **kwargs)  # safetensors: the default since transformers 4.35
    # save_pretrained rewrote config.json in transformers' own form; the test wants the source's bytes.
    (out / "config.json").write_text(json.dumps(config_json or raw, indent=2) + "\n")
    return out


def _save_fused(model, out: Path, *, shard_bytes: int | None) -> None:
    """Save a per-expert (transformers 4) model with its routed experts fused as transformers 5 stores them:
    ``torch.stack`` over experts of ``cat([gate, up])`` and of ``down`` (its ``MergeModulelist(dim=0)`` and
    ``Concatenate(dim=1)``), sharded with huggingface_hub as ``save_pretrained`` does."""
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    tied = model.config.tie_word_embeddings
    state = {k: v for k, v in model.state_dict().items() if not (k == "lm_head.weight" and tied)}
    experts: dict[str, dict[int, dict[str, Any]]] = {}
    fused: dict[str, Any] = {}
    for name, tensor in state.items():
        match = re.match(r"^(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", name)
        if match is None:
            fused[name] = tensor
            continue
        layer = experts.setdefault(match[1], {})
        layer.setdefault(int(match[2]), {})[match[3]] = tensor
        fused.setdefault(f"{match[1]}.gate_up_proj", None)  # keep the layer's place in the order
        fused.setdefault(f"{match[1]}.down_proj", None)
    for prefix, by_number in experts.items():
        numbers = sorted(by_number)
        fused[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([by_number[n]["gate_proj"], by_number[n]["up_proj"]]) for n in numbers])
        fused[f"{prefix}.down_proj"] = torch.stack([by_number[n]["down_proj"] for n in numbers])
    fused = {k: v.contiguous() for k, v in fused.items()}
    split = split_torch_state_dict_into_shards(fused, max_shard_size=shard_bytes or "50GB")
    for file, names in split.filename_to_tensors.items():
        save_file({n: fused[n] for n in names}, out / file, metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in fused.values())},
                 "weight_map": split.tensor_to_filename}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_tokenizer(out: str | Path, *, vocab_size: int) -> None:
    """A tiny word-level fast tokenizer (``w0`` ... ``w{n-1}``) saved the way HF repositories ship one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)


def qwen3_dir(
    out: str | Path, *, seed: int = 0, dtype: str = "float32", shard_bytes: int | None = None, tokenizer: bool = True
) -> Path:
    """Dense Qwen3, with a tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) unless told otherwise."""
    path = write_hf_dir(out, QWEN3_TINY, seed=seed, dtype=dtype, shard_bytes=shard_bytes)
    if tokenizer:
        write_tokenizer(path, vocab_size=QWEN3_TINY["vocab_size"])
    return path


def qwen3_tied_dir(out: str | Path, *, seed: int = 0, dtype: str = "bfloat16", shard_bytes: int | None = None) -> Path:
    """Qwen3 with tied input/output embeddings in bf16, like Qwen3-0.6B / 1.7B / 4B."""
    config = dict(QWEN3_TINY, tie_word_embeddings=True)
    return write_hf_dir(out, config, seed=seed, dtype=dtype, shard_bytes=shard_bytes)


def qwen3_moe_dir(
    out: str | Path, *, seed: int = 0, dtype: str = "float32", shard_bytes: int | None = None,
    expert_layout: Literal["per_expert", "fused"] = "per_expert",
) -> Path:
    return write_hf_dir(out, QWEN3_MOE_TINY, seed=seed, dtype=dtype, shard_bytes=shard_bytes,
                        expert_layout=expert_layout)  # fmt: skip


def kimi_k2_config(*, dtype: str = "bfloat16", **overrides: Any) -> dict[str, Any]:
    """The real Kimi K2 ``config.json`` with tiny sizes (and without the fp8 ``quantization_config``)."""
    raw = json.loads(KIMI_K2_CONFIG.read_text())
    raw.pop("quantization_config")  # tiny fixtures store plain floating-point weights
    raw.update(KIMI_K2_TINY_SIZES)
    raw["torch_dtype"] = dtype
    raw.update(overrides)
    return raw


def kimi_k2_dir(
    out: str | Path, *, seed: int = 0, dtype: str = "bfloat16", shard_bytes: int | None = None,
    expert_layout: Literal["per_expert", "fused"] = "per_expert", **overrides: Any,
) -> Path:
    raw = kimi_k2_config(dtype=dtype, **overrides)
    return write_hf_dir(out, raw, seed=seed, dtype=dtype, shard_bytes=shard_bytes, config_json=raw,
                        expert_layout=expert_layout)  # fmt: skip


# Linear weights that DeepSeek-V3 / Kimi K2 releases store in fp8 (not embeddings, lm_head, norms, router).
_FP8_WEIGHTS = ("_proj.weight",)


def quantize_fp8(weight, block: tuple[int, int]):
    """bf16/fp32 -> (float8_e4m3fn weight, float32 scale_inv) with one scale per ``block`` tile.

    The inverse of the releases' dequantization ``W = W_fp8 * scale_inv`` (scale = tile max / 448).
    """
    import math

    import torch

    rows, cols = weight.shape
    br, bc = block
    w = weight.to(torch.float32)
    scale = torch.empty(math.ceil(rows / br), math.ceil(cols / bc))
    out = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * br : (i + 1) * br, j * bc : (j + 1) * bc]
            s = tile.abs().max().clamp(min=1e-12) / 448.0
            scale[i, j] = s
            out[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = (tile / s).to(torch.float8_e4m3fn)
    return out, scale


def kimi_k2_fp8_dir(
    out: str | Path, *, seed: int = 0, block: tuple[int, int] = (16, 16), shard_bytes: int | None = None
) -> Path:
    """Kimi-K2-style checkpoint stored like the real release: fp8 (e4m3) linear weights with block scales.

    ``config.json`` keeps the real ``quantization_config`` (with a small ``weight_block_size`` so the tiny
    matrices have several tiles).
    """
    import torch
    from safetensors.torch import load_file, save_file

    out = Path(out)
    kimi_k2_dir(out, seed=seed, dtype="bfloat16", shard_bytes=shard_bytes)
    raw = json.loads((out / "config.json").read_text())
    quant = json.loads(KIMI_K2_CONFIG.read_text())["quantization_config"]
    quant["weight_block_size"] = list(block)
    raw["quantization_config"] = quant
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    index_file = out / "model.safetensors.index.json"
    index = json.loads(index_file.read_text()) if index_file.exists() else None
    for file in sorted(out.glob("*.safetensors")):
        tensors = load_file(file)
        converted: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            if name.endswith(_FP8_WEIGHTS) and tensor.dim() == 2 and "mlp.gate." not in name:
                converted[name], converted[f"{name}_scale_inv"] = quantize_fp8(tensor, block)
                if index is not None:
                    index["weight_map"][f"{name}_scale_inv"] = file.name
            else:
                converted[name] = tensor
        save_file(converted, file, metadata={"format": "pt"})
    if index is not None:
        index_file.write_text(json.dumps(index, indent=2))
    return out


# Kimi-K2-Thinking's released quantization_config (recipes/hf_configs/kimi_k2_thinking/README.md): int4 routed experts.
KIMI_K2_THINKING_CONFIG = REPO / "recipes" / "hf_configs" / "kimi_k2_thinking" / "config.json"
_ROUTED_EXPERT = re.compile(r"^.+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def pack_int4(q, *, nibble_order: Literal["low_first", "high_first"] = "low_first"):
    """int8 values in -8..7 [rows, cols] -> int32 [rows, ceil(cols / 8)], as compressed-tensors' ``pack_to_int32``
    describes it (``compressors/quantized_compressors/pack_quantized.py``): shift to unsigned (+8), pad the row to
    a multiple of 8, and put value ``i`` of each group of 8 in bits ``4 i`` up ("[129, 130, 0, 0] -> 00000000
    00000000 10000010 10000001": the first value in the lowest bits). ``high_first`` is the wrong order (a negative
    control)."""
    import numpy as np
    import torch

    rows, cols = q.shape
    words = -(-cols // 8)
    unsigned = np.zeros((rows, words * 8), dtype=np.uint32)
    unsigned[:, :cols] = (q.to(torch.int16) + 8).numpy().astype(np.uint32)
    packed = np.zeros((rows, words), dtype=np.uint32)
    for i in range(8):
        shift = 4 * i if nibble_order == "low_first" else 4 * (7 - i)
        packed |= unsigned[:, i::8] << shift
    return torch.from_numpy(packed.view(np.int32).copy())


def int4_representable(weight, group_size: int, generator):
    """(bf16 weight that int4 with power-of-two group scales holds exactly, int8 values, bf16 scales).

    Each group's scale is a power of two near max|w| / 7, so ``q * scale`` (|q| <= 8) is exact in bf16: the format
    is lossless for these values and the dequantized matrix must equal the bf16 one bit for bit."""
    import torch

    rows, cols = weight.shape
    groups = -(-cols // group_size)
    w = weight.to(torch.float32)
    padded = torch.zeros(rows, groups * group_size)
    padded[:, :cols] = w
    amax = padded.view(rows, groups, group_size).abs().amax(-1).clamp(min=1e-6)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 7)))  # [rows, groups]
    per_column = scale.repeat_interleave(group_size, 1)[:, :cols]
    q = torch.clamp(torch.round(w / per_column), -8, 7) + 0.0  # int4 has no -0: the bf16 twin holds +0 too
    # one value per row at the extremes, so every nibble value's packing is exercised
    q[:, 0], q[:, -1] = -8, 7
    return (q * per_column).to(torch.bfloat16), q.to(torch.int8), scale.to(torch.bfloat16)


def kimi_k2_thinking_int4_dir(
    out: str | Path, *, seed: int = 0, group_size: int = 32, shard_bytes: int | None = None,
    stated_group_size: int | None = None, nibble_order: Literal["low_first", "high_first"] = "low_first",
    reference: str | Path | None = None,
) -> Path:
    """A Kimi-K2-Thinking-shaped checkpoint stored as the release is: routed experts in compressed-tensors
    ``pack-quantized`` int4 (``weight_packed`` / ``weight_scale`` per ``group_size`` input columns /
    ``weight_shape``), the rest bf16; config.json is the tiny Kimi K2 one with the release's
    ``quantization_config`` (``stated_group_size`` overrides the group size it states: a negative control).

    ``reference``: where to also write the same model unquantized (bf16, the values int4 holds exactly).
    """
    import torch
    from safetensors.torch import load_file, save_file

    out = Path(out)
    kimi_k2_dir(out, seed=seed, dtype="bfloat16", shard_bytes=shard_bytes)
    raw = json.loads((out / "config.json").read_text())
    quant = json.loads(KIMI_K2_THINKING_CONFIG.read_text())["quantization_config"]
    quant["config_groups"]["group_0"]["weights"]["group_size"] = stated_group_size or group_size
    generator = torch.Generator().manual_seed(seed)
    index_file = out / "model.safetensors.index.json"
    index = json.loads(index_file.read_text()) if index_file.exists() else None
    if reference is not None:
        shutil.copytree(out, reference)
    for file in sorted(out.glob("*.safetensors")):
        tensors = load_file(file)
        plain, packed = dict(tensors), {}
        for name, tensor in tensors.items():
            if _ROUTED_EXPERT.match(name):
                exact, q, scale = int4_representable(tensor, group_size, generator)
                plain[name] = exact
                module = name[: -len(".weight")]
                packed[f"{module}.weight_packed"] = pack_int4(q, nibble_order=nibble_order)
                packed[f"{module}.weight_scale"] = scale
                packed[f"{module}.weight_shape"] = torch.tensor(list(tensor.shape), dtype=torch.int32)
                if index is not None:
                    del index["weight_map"][name]
                    index["weight_map"].update({k: file.name for k in packed if k.startswith(f"{module}.")})
            else:
                packed[name] = tensor
        save_file(packed, file, metadata={"format": "pt"})
        if reference is not None:
            save_file(plain, Path(reference) / file.name, metadata={"format": "pt"})
    raw["quantization_config"] = quant
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    if index is not None:
        index_file.write_text(json.dumps(index, indent=2))
    return out
