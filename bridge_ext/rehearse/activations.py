"""One micro-batch forward + backward through a rank's model chunks: peak activation bytes and model FLOPs.

What Megatron's pipeline schedule does with one micro-batch on one rank, on whatever tensors the chunks hold
(fake ones in a rehearsal, real ones in the tests' reference run):

- inputs as Megatron Bridge's ``gpt_step`` passes them: token ids, labels and position ids ``[MBS, seq / CP]``
  (int64), no attention mask (pre-training data sets give none: the causal mask is the kernel's); a chunk that
  is not the first of the model gets a hidden-state input ``[seq / CP / (TP with sequence parallelism), MBS,
  hidden]`` in the pipeline dtype through its ``set_input_tensor``, as received from the previous stage;
- every chunk of the rank runs forward in turn (virtual pipeline: the micro-batch through all of the rank's
  chunks, as the interleaved schedule has it in flight), then backward in reverse order: from the loss
  (the per-token losses summed, what ``loss_func`` reduces) on the model's last chunk, from an output
  gradient of the output's shape on any other;
- :class:`LiveBytes` (a ``TorchDispatchMode``) counts every storage an op creates from the forward's start,
  and releases it when the storage dies: its peak is the activation memory of the micro-batch above what the
  rank held before (weights, DDP's grad buffers, optimizer state); the received inputs and output gradients
  count, since they live in that window; the bytes in ``[..., seq, seq]`` tensors at the peak are reported
  apart (the local attention path's scores and probabilities, which flash attention never materializes);
- ``torch.utils.flop_counter.FlopCounterMode`` over the same forward + backward: the matmuls' FLOPs
  (``mm``, ``addmm``, ``bmm``, ``baddbmm``, attention kernels), forward and both backward GEMMs.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveBytes", "MicroBatch", "attention_paths", "micro_batch"]


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages ops create while the mode is on, as long as they live: ``current`` and ``peak``.

    A storage is counted once (views and in-place results, outputs on an input's storage, add nothing) at its
    size when first seen, and
    released by a weak reference's callback when it is freed (torch keeps one Python object per storage).
    Storages that existed before the mode was entered are never counted. ``square``: a sequence length; the
    bytes of tensors whose last two dimensions are ``square x square`` (attention scores, probabilities, masks:
    what a kernel without flash attention materializes) are also kept apart, ``square_at_peak`` being their
    share of ``peak``. ``at_peak``: the bytes live at the peak by the op (and dtype) that made them."""

    def __init__(self, square: int | None = None, where: Callable[[], str] | None = None) -> None:
        super().__init__()
        self._where = where
        self.current = 0
        self.peak = 0
        self.square = square
        self.current_square = 0
        self.square_at_peak = 0
        self.at_peak: dict[str, int] = {}
        self._by_op: dict[str, int] = {}
        self._op = ""
        self._live: dict[StorageWeakRef, tuple[int, Any, bool, str]] = {}

    def _release(self, key: StorageWeakRef, nbytes: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current -= nbytes
            self._by_op[entry[3]] -= nbytes
            if entry[2]:
                self.current_square -= nbytes

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = StorageWeakRef(storage)
        if key in self._live:
            return
        nbytes = storage.nbytes()
        square = self.square is not None and tensor.dim() >= 2 and tuple(tensor.shape[-2:]) == (self.square,) * 2
        ref = weakref.ref(storage, lambda _ref, key=key, nbytes=nbytes: self._release(key, nbytes))
        label = f"{self._op} {str(tensor.dtype).removeprefix('torch.')}"
        if self._where is not None:
            label = f"{self._where()}: {label}"
        self._live[key] = (nbytes, ref, square, label)
        self.current += nbytes
        self._by_op[label] = self._by_op.get(label, 0) + nbytes
        self.current_square += nbytes if square else 0
        if self.current > self.peak:
            self.peak, self.square_at_peak = self.current, self.current_square
            self.at_peak = dict(self._by_op)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace in ("c10d", "_c10d_functional"):
            return out
        self._op = f"{func.namespace}.{func.__name__.split('.')[0]}"
        # an output on an input's storage (a view, an in-place result) is not a new allocation
        inputs = {StorageWeakRef(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.layout == torch.strided}
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor) and value.layout == torch.strided:
                if StorageWeakRef(value.untyped_storage()) not in inputs:
                    self._track(value)
        return out

    def forget(self) -> None:
        """Stop counting the storages seen so far (called after the window closes)."""
        self._live.clear()


@dataclass(frozen=True)
class MicroBatch:
    peak_bytes: int  # peak of the bytes created during the forward + backward and still alive
    square_bytes: int  # of them, in [..., seq, seq] tensors (attention scores, probabilities, masks)
    peak_by_op: dict[str, int]  # bytes live at the peak by module, op and dtype that made them, largest first
    flops: int  # FlopCounterMode's total over the forward + backward
    flops_by_op: dict[str, int]
    micro_batch_size: int
    seq_length: int
    chunks: int


def attention_paths(model: list[Any]) -> list[str]:
    """The core-attention classes the chunks run (``module.path.ClassName``), each once."""
    seen: dict[str, None] = {}
    for chunk in model:
        for name, module in chunk.named_modules():
            if name.endswith("core_attention"):
                cls = type(module)
                seen[f"{cls.__module__}.{cls.__qualname__}"] = None
    return list(seen)


def _module_label(parents: set[str]) -> str:
    """The innermost module running, layer numbers as ``*`` (``decoder.layers.*.mlp.linear_fc1``)."""
    inner = max(parents, key=lambda name: name.count("."), default="")
    for root in ("decoder.", "embedding.", "output_layer"):
        if root in inner:
            inner = inner[inner.index(root):]
            break
    else:
        inner = inner.rsplit(".", 1)[-1] if "." in inner else inner
    return re.sub(r"\.\d+(?=\.|$)", ".*", inner) or "-"


def _unwrapped(chunk: Any, attr: str) -> Any:
    from megatron.core.utils import get_attr_wrapped_model

    return get_attr_wrapped_model(chunk, attr)


def micro_batch(model: list[Any], *, micro_batch_size: int, seq_length: int, hidden_size: int,
                tp: int, cp: int, sequence_parallel: bool, dtype: torch.dtype, device: str = "cpu") -> MicroBatch:
    """Forward + backward of one micro-batch through ``model`` (this rank's DDP-wrapped chunks), measured."""
    from torch.utils.flop_counter import FlopCounterMode

    from torch.utils.module_tracker import ModuleTracker

    seq = seq_length // cp
    modules = ModuleTracker()
    tracker = LiveBytes(square=seq, where=lambda: _module_label(modules.parents))
    counter = FlopCounterMode(display=False)
    for chunk in model:
        chunk.train()
        zero = getattr(chunk, "zero_grad_buffer", None)
        if zero is not None:
            zero()
    with modules, tracker, counter:
        outputs = []
        for chunk in model:
            pre, post = _unwrapped(chunk, "pre_process"), _unwrapped(chunk, "post_process")
            tokens = torch.zeros(micro_batch_size, seq, dtype=torch.long, device=device)
            position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(micro_batch_size, -1)
            if pre:
                _unwrapped(chunk, "set_input_tensor")(None)
            else:
                rows = seq // tp if sequence_parallel and tp > 1 else seq
                received = torch.zeros(rows, micro_batch_size, hidden_size, dtype=dtype, device=device,
                                       requires_grad=True)
                _unwrapped(chunk, "set_input_tensor")(received)
            out = chunk(input_ids=tokens, position_ids=position_ids, attention_mask=None,
                        labels=tokens if post else None)
            outputs.append((out, post))
            del tokens, position_ids
        for out, post in reversed(outputs):
            if post:
                out.float().sum().backward()
            else:
                torch.autograd.backward(out, grad_tensors=torch.ones_like(out))
        del outputs, out
    tracker.forget()
    for chunk in model:
        _unwrapped(chunk, "set_input_tensor")(None)
    flops_by_op = {str(op): int(n) for op, n in counter.get_flop_counts().get("Global", {}).items()}
    by_op = dict(sorted(((k, v) for k, v in tracker.at_peak.items() if v), key=lambda kv: -kv[1]))
    return MicroBatch(peak_bytes=tracker.peak, square_bytes=tracker.square_at_peak, peak_by_op=by_op,
                      flops=int(counter.get_total_flops()), flops_by_op=flops_by_op,
                      micro_batch_size=micro_batch_size, seq_length=seq_length, chunks=len(model))
