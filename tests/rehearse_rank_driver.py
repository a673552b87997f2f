"""One real training iteration of proxy recipes on 2 gloo processes, and what each rank's objects hold after it
(for tests/test_rehearse.py: the rehearsal of the same ranks on fake tensors must equal it).

Run as ``torchrun --standalone --nproc-per-node 2 tests/rehearse_rank_driver.py OUT_DIR RECIPE:LAYOUT ...``:
every case runs ``nemo llm pretrain``'s own path (``bridge_ext.build.build_config``, ``bridge_ext.training``:
CPU mode, Megatron Bridge's ``pretrain()`` with its ``setup_optimizer``) for one iteration on mock data; a
callback at the end of that step counts, from the live objects and without ``bridge_ext.rehearse``:
parameters (elements of the model chunks' parameters; the routed experts apart, by name: ``.mlp.experts.``, at
any EP, where megatron-core marks them ``allreduce=False`` only at EP > 1), the DDP grad buffers' bytes, the bytes
of the tensors the optimizers step that are not the model's own storage (fp32 main copies) and the bytes of
every tensor in the torch optimizers' ``state``. Every rank writes ``OUT_DIR/rank<R>.json`` = [{recipe,
layout, rank, params, expert_params, grads, main_params, optimizer_state}, ...].
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _inner_optimizers(optimizer):
    """The torch optimizers inside a Megatron optimizer (chained and layer-wise ones flattened)."""
    members = getattr(optimizer, "chained_optimizers", None)
    if members is None:
        inner = getattr(optimizer, "optimizer", None)
        return [inner] if inner is not None else []
    return [inner for member in members for inner in _inner_optimizers(member)]


def _count(model, optimizer) -> dict[str, int]:
    import torch

    def storage(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()

    params = [p for chunk in model for p in chunk.parameters()]
    routed = [p for chunk in model for name, p in chunk.named_parameters() if ".mlp.experts." in name]
    buffers = [b for chunk in model for b in (*chunk.buffers, *chunk.expert_parallel_buffers)]
    model_storages = {storage(p) for p in params}
    for buffer in buffers:
        model_storages |= {storage(t) for t in (buffer.param_data, buffer.grad_data) if t is not None}
    seen: set[int] = set()
    main = state = 0
    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                if storage(p) not in model_storages and storage(p) not in seen:
                    seen.add(storage(p))
                    main += p.untyped_storage().nbytes()
        for values in inner.state.values():
            for value in values.values():
                if torch.is_tensor(value) and storage(value) not in seen:
                    seen.add(storage(value))
                    state += value.untyped_storage().nbytes()
    return {"params": sum(p.numel() for p in params),
            "expert_params": sum(p.numel() for p in routed),
            "grads": sum(b.grad_data.untyped_storage().nbytes() for b in buffers),
            "main_params": main, "optimizer_state": state}


def main(out: Path, cases: list[str]) -> None:
    from bridge_ext.cpu import enable_cpu_mode

    enable_cpu_mode()  # before Megatron Bridge's imports (Transformer Engine's stand-ins)
    import torch
    import torch.distributed as dist
    from megatron.bridge.training.callbacks import Callback

    from bridge_ext.build import build_config, quiet_megatron
    from bridge_ext.cpu import init_cpu_distributed
    from bridge_ext.process_state import reset_megatron_globals
    from bridge_ext.training import prepare, run_pretrain
    from recipes import get_recipe

    torch.set_num_threads(1)
    quiet_megatron()
    init_cpu_distributed()
    rank = dist.get_rank()
    records: list[dict] = []

    class Count(Callback):
        def __init__(self, recipe: str, layout: str):
            self.where = {"recipe": recipe, "layout": layout, "rank": rank}

        def on_train_step_end(self, context):
            assert not context.skipped_iter, "the iteration was skipped: no optimizer state to count"
            records.append({**self.where, **_count(context.model, context.optimizer)})

    for case in cases:
        name, layout = case.split(":")
        recipe = get_recipe(name)
        reset_megatron_globals()
        cfg = build_config(recipe, layout=layout, values={
            "train.train_iters": 1, "checkpoint.save": None, "checkpoint.load": None,
            "logger.tensorboard_dir": str(out / "tb" / name / layout), "logger.log_interval": 1})
        prepared = prepare(recipe, cfg, device="cpu", data="mock", quiet=True, telemetry=False)
        run_pretrain(cfg, prepared, callbacks=[Count(name, layout)])
        dist.barrier()
    reset_megatron_globals()
    (out / f"rank{rank}.json").write_text(json.dumps(records))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(Path(sys.argv[1]), sys.argv[2:])
