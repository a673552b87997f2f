"""Build proxy models under model-parallel layouts and record what each rank holds (for tests/test_plan.py).

Run as ``torchrun --nproc-per-node 2 tests/plan_rank_driver.py OUT_DIR RECIPE:LAYOUT ...``: every rank writes
``OUT_DIR/rank<R>.json`` = [{recipe, layout, pp_rank, tp_rank, ep_rank, numels: [...]}, ...]. The model is
built only (no optimizer, no data), with megatron-core's parallel state and the recipe's own provider in
the local (CPU) layer spec, on gloo.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(out: Path, cases: list[str]) -> None:
    from bridge_ext.cpu import enable_cpu_mode

    enable_cpu_mode()
    import torch
    import torch.distributed as dist

    from bridge_ext.build import model_provider, quiet_megatron
    from bridge_ext.cpu.config import configure_for_cpu
    from bridge_ext.process_state import reset_megatron_globals
    from megatron.core import parallel_state
    from recipes import get_recipe

    quiet_megatron()
    dist.init_process_group("gloo")
    records = []
    for case in cases:
        name, layout_name = case.split(":")
        recipe = get_recipe(name)
        layout = recipe.layout(layout_name)
        provider = model_provider(recipe)
        configure_for_cpu(provider)
        provider.tensor_model_parallel_size = layout.tp
        provider.pipeline_model_parallel_size = layout.pp
        provider.virtual_pipeline_model_parallel_size = layout.vp
        provider.expert_model_parallel_size = layout.ep
        provider.expert_tensor_parallel_size = layout.etp
        provider.sequence_parallel = False  # no parameter depends on it; torch norms (CPU) refuse it
        provider.pipeline_model_parallel_layout = layout.pipeline_layout
        if layout.pipeline_layout:
            provider.account_for_embedding_in_pipeline_split = False
            provider.account_for_loss_in_pipeline_split = False
        provider.pipeline_dtype = torch.float32 if layout.pp > 1 else None
        provider.finalize()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vp, expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp)
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)
        chunks = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True,
                                                    mixed_precision_wrapper=None)
        numels = sorted(p.numel() for chunk in chunks for p in chunk.parameters())
        records.append({"recipe": name, "layout": layout_name, "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
                        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                        "ep_rank": parallel_state.get_expert_model_parallel_rank(), "numels": numels})
        del chunks
        parallel_state.destroy_model_parallel()
        reset_megatron_globals()
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(records))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(Path(sys.argv[1]), sys.argv[2:])
