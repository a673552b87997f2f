"""INT4 releases in compressed-tensors' ``pack-quantized`` format (Kimi-K2-Thinking's routed experts): dequantized
to the checkpoint's float dtype on import, like the fp8 releases (:mod:`bridge_ext.hf.fp8`).

The format (compressed-tensors ``compressors/quantized_compressors/pack_quantized.py``, ``pack_to_int32`` /
``unpack_from_int32``; transformers' compressed-tensors docs): a quantized ``Linear`` ``X`` stores, instead of
``X.weight`` [out, in],

* ``X.weight_packed`` int32 [out, ceil(in / 8)]: the int4 values of each row, offset by +8 to 0..15, eight to a
  word along the input dimension, column ``8 j + i`` in bits ``4 i .. 4 i + 3`` of word ``j`` (zero-padded);
* ``X.weight_scale`` [out, ceil(in / group_size)]: one scale per group of ``group_size`` input columns;
* ``X.weight_shape`` [2]: the unpacked shape (the padding is cut off).

Symmetric (no zero point): ``W[r, c] = q[r, c] * scale[r, c // group_size]``. Which modules are quantized is what
the checkpoint stores packed; ``quantization_config.ignore`` (names, or ``re:`` regular expressions matched from
the start of the module name) must not name any of them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from bridge_ext.errors import UserError

__all__ = ["COMPANIONS", "Int4Scheme", "dequantize_int4", "int4_scheme", "int4_weights", "read_int4", "unpack_int4"]

COMPANIONS = ("weight_packed", "weight_scale", "weight_shape")  # what stands for ``X.weight``
_UNSUPPORTED = ("weight_zero_point", "weight_g_idx")  # asymmetric / activation-ordered variants
PACK = 8  # int4 values per int32


@dataclass(frozen=True)
class Int4Scheme:
    group_size: int
    ignore: tuple[str, ...]

    def ignores(self, module: str) -> bool:
        return any(re.match(p[3:], module) if p.startswith("re:") else p == module for p in self.ignore)


def int4_scheme(quant: Mapping[str, Any], *, where: Any) -> Int4Scheme | None:
    """The scheme of a compressed-tensors ``quantization_config``; None for another method; a one-line
    ``UserError`` for a compressed-tensors variant this import does not dequantize."""
    if quant.get("quant_method") != "compressed-tensors":
        return None
    groups = list((quant.get("config_groups") or {}).values())
    formats = {quant.get("format")} | {g.get("format") for g in groups if g.get("format")}
    weights = [g.get("weights") or {} for g in groups]
    schemes = {(w.get("num_bits"), w.get("type"), w.get("symmetric"), w.get("strategy"), w.get("group_size"),
                bool(w.get("actorder")), bool(w.get("dynamic"))) for w in weights}  # fmt: skip
    acts = [g.get("input_activations") for g in groups if g.get("input_activations")]
    ok = (formats == {"pack-quantized"} and len(schemes) == 1 and not acts
          and quant.get("quantization_status", "compressed") == "compressed")
    bits, kind, symmetric, strategy, group, actorder, dynamic = next(iter(schemes)) if schemes else (None,) * 7
    if not (ok and (bits, kind, symmetric, strategy) == (4, "int", True, "group") and isinstance(group, int)
            and group > 0 and not actorder and not dynamic):
        raise UserError(
            f"{where}: compressed-tensors quantization_config not supported (import reads format pack-quantized, "
            f"weight-only int4 symmetric with strategy group and one group_size; got format {sorted(map(str, formats))}"
            f", weights {[dict(w) for w in weights]}, input_activations {acts or None})")
    return Int4Scheme(group_size=group, ignore=tuple(quant.get("ignore") or ()))


def int4_weights(
    shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, str], scheme: Int4Scheme, *,
    expected: Mapping[str, tuple[int, ...]] | None, where: Any,
) -> dict[str, tuple[int, ...]]:
    """``X.weight`` -> its unpacked shape, for every ``X.weight_packed`` of a checkpoint (header shapes and
    safetensors dtype codes); a one-line ``UserError`` when the tensors do not form the format."""
    out = {}
    for name, shape in shapes.items():
        if name.endswith(_UNSUPPORTED):
            raise UserError(f"{where}: tensor {name}: asymmetric or activation-ordered int4 is not supported")
        if not name.endswith(".weight_packed"):
            continue
        module = name[: -len(".weight_packed")]
        scale, stated = shapes.get(f"{module}.weight_scale"), shapes.get(f"{module}.weight_shape")
        if scale is None or stated is None:
            raise UserError(f"{where}: {name} has no {module}.weight_scale / {module}.weight_shape")
        if f"{module}.weight" in shapes:
            raise UserError(f"{where}: {module} is stored both packed and as {module}.weight")
        if scheme.ignores(module):
            raise UserError(f"{where}: quantization_config ignores {module}, but the checkpoint stores it packed")
        if dtypes[name] != "I32" or stated != (2,) or len(shape) != 2:
            raise UserError(f"{where}: {name} must be int32 [out, in/8] with an int [2] weight_shape")
        rows, words = shape
        cols = (expected or {}).get(f"{module}.weight", (rows, min(words * PACK, scale[1] * scheme.group_size)))[1]
        if scale != (rows, math.ceil(cols / scheme.group_size)) or words != math.ceil(cols / PACK):
            raise UserError(
                f"{where}: {module} packed {list(shape)} with scales {list(scale)} does not hold a [{rows}, {cols}] "
                f"weight in groups of {scheme.group_size} (config.json)")
        out[f"{module}.weight"] = (rows, cols)
    return out


def unpack_int4(packed: Any, cols: int) -> Any:
    """int32 [rows, words] -> int8 [rows, cols] in -8..7 (column ``8 j + i`` is nibble ``i`` of word ``j``)."""
    import torch

    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF  # [rows, words, 8]
    return (nibbles.reshape(packed.shape[0], -1)[:, :cols] - 8).to(torch.int8)


def dequantize_int4(packed: Any, scale: Any, shape: tuple[int, int], group_size: int, dtype: Any) -> Any:
    """``W = q * scale`` per group of ``group_size`` input columns, in fp32 (exact: 4-bit values), cast to
    ``dtype``."""
    import torch

    rows, cols = shape
    q = unpack_int4(packed, cols).to(torch.float32)
    per_column = scale.to(torch.float32).repeat_interleave(group_size, 1)[:, :cols]
    return (q * per_column).reshape(rows, cols).to(dtype)


def read_int4(name: str, read: Callable[[str], Any], scheme: Int4Scheme, dtype: Any) -> Any:
    """The dequantized ``X.weight`` from its stored tensors, each read with ``read(stored name)``."""
    module = name[: -len(".weight")]
    shape = tuple(int(v) for v in read(f"{module}.weight_shape").tolist())
    return dequantize_int4(read(f"{module}.weight_packed"), read(f"{module}.weight_scale"), shape,
                           scheme.group_size, dtype)
