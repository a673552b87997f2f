"""``nemo llm rehearse``: one rank of a recipe's real layout built by Megatron on fake tensors, against ``plan``.

The expected values are Megatron's own objects (the rank's model chunks, DDP buffers and optimizer, read by
``bridge_ext.rehearse.measure``) and hand counts; the code under test is ``nemo llm plan``'s (``bridge_ext.plan``):
parameters per rank exactly, weights, grad buffer, fp32 main params and optimizer state within 1 %, and the
Newton-Schulz FLOPs one ``optimizer.step()`` runs on the rank (torch's FlopCounterMode) equal to the manifest's.
"""

from __future__ import annotations

import json

import pytest

from bridge_ext.errors import UserError
from bridge_ext.rehearse import rehearse, select_ranks

MEMORY = ("weights", "grads", "main_params", "optimizer_state")


def _check(result: dict, *, step: bool) -> None:
    """``result``: one rank's ``Rehearsal.to_json()`` (the API's or ``--json``'s)."""
    measured, planned = result["measured"], result["planned"]
    assert measured["params"] == planned["params"]
    assert measured["expert_params"] == planned["expert_params"]
    for key in MEMORY:
        assert planned[key] == pytest.approx(measured[key], rel=0.01), key
    if "DistributedOptimizer(" not in result["optimizer"]:  # no buffer padding without the distributed optimizer
        assert measured["weights"] == 2 * measured["params"]  # bf16
        assert measured["grads"] == 4 * measured["params"]  # fp32 grad buffer (grad_reduce_in_fp32)
    if step:
        assert result["ns_flops"] == pytest.approx(result["planned_ns_flops"], rel=1e-9)
        assert (result["ns_flops"] > 0) == ("Muon" in result["optimizer"])


@pytest.mark.once
def test_rank_selection():
    assert select_ranks("first,last", world=256, pp=4) == (0, 255)
    assert select_ranks("all-pp,3", world=256, pp=4) == (0, 64, 128, 192, 3)
    for bad in ("256", "-1", "0,middle"):
        with pytest.raises(UserError):
            select_ranks(bad, world=256, pp=4)


@pytest.mark.slow
def test_bad_input_is_one_line_and_exit_2(nemo, cpu_mode):
    for argv, says in (
        (["--recipe", "kimi_k2_muon", "--rank", "256"], "outside layout gb300x256's world of 256 ranks"),
        (["--recipe", "kimi_k2_muon", "--ranks", "0,middle"], "got 'middle'"),
        (["--recipe", "qwen3_8b_muon", "model.tensor_parallel_size=2"], "did you mean"),
        # TP64 over Qwen3-8B's 32 attention heads: Megatron's TransformerConfig refuses it
        (["--recipe", "qwen3_8b_muon", "model.tensor_model_parallel_size=64", "gpus=64"], "does not validate"),
        (["--recipe", "qwen3_8b_muon", "--device", "cuda"], "needs a visible GPU"),
    ):
        result = nemo(["llm", "rehearse", *argv])
        assert result.code == 2, (argv, result)
        assert says in result.stderr and result.stderr.count("\n") == 1 and not result.stdout, (argv, result)


@pytest.mark.stack
@pytest.mark.slow
def test_qwen3_8b_tp4_rank0_distributed_adamw_equals_plan(cpu_mode):
    (rehearsed,) = rehearse("qwen3_8b_adamw", layout="h100x8", ranks=(0,), step=False)
    result = rehearsed.to_json()
    # by hand (Qwen3-8B config.json, TP4): per layer QKV (32 + 2 x 8) x 128 x 4096, proj 4096 x 4096, fc1
    # 2 x 12288 x 4096, fc2 4096 x 12288 (each / 4), two norms of 4096 and the q/k norms of 128; embedding and
    # output layer 151,936 x 4096 / 4 each; the final norm
    layer = ((32 + 16) * 128 * 4096 + 4096 * 4096 + 2 * 12288 * 4096 + 4096 * 12288) // 4 + 2 * 4096 + 2 * 128
    assert result["measured"]["params"] == 36 * layer + 2 * 151936 * 4096 // 4 + 4096 == 2_047_915_008
    assert result["optimizer"] == "ChainedOptimizer[DistributedOptimizer(AdamW)]"
    where = result["coordinates"]
    assert (where["tp"], where["dp"], where["dp_size"]) == (0, 0, 2)
    _check(result, step=False)


@pytest.mark.stack
@pytest.mark.slow
def test_kimi_k2_last_rank_layer_wise_muon_equals_plan(nemo, cpu_mode):
    """Rank 255 of 256 (last pipeline stage of PP4 x VP4, EP rank 63): one Muon step, gate and up apart; through
    the command, whose --json is the whole of stdout."""
    done = nemo(["llm", "rehearse", "--recipe", "kimi_k2_muon", "--ranks", "last", "--json"])
    assert done.code == 0, done.stderr[-2000:]
    (result,) = json.loads(done.stdout)
    where = result["coordinates"]
    assert (where["rank"], where["pp"], where["ep"], where["dp"], where["dp_size"], where["expert_dp_size"]) == (
        255, 3, 63, 63, 64, 1)
    assert result["optimizer"].startswith("LayerWiseDistributedOptimizer[")
    _check(result, step=True)
    # every routed expert of the rank is Muon's and its own (expert DP 1): fp32 main + momentum for all of them
    assert result["measured"]["main_params"] >= 4 * result["measured"]["expert_params"]


# Minutes each on a loaded 2-core machine (Qwen3-30B-A3B's rank holds 1,536 expert matrices: ~40,000 fake-tensor
# dispatches to build); its AdamW twin (16 min measured under load) was run by hand: docs/launch.md.
@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.parametrize("recipe, layout, ranks, step", [
    ("qwen3_8b_muon", "h100x8", (4,), True),  # the data-parallel rank the layer-wise optimizer gives the embedding
    ("kimi_k2_muon", "gb300x256", (0,), True),
    ("kimi_k2_adamw", "gb300x256", (0,), False),
    ("qwen3_30b_a3b_muon", "gb300x8", (0,), False),
    ("qwen3_235b_a22b_muon", "h100x128", (0,), False),
])
def test_rehearsal_equals_plan(cpu_mode, recipe, layout, ranks, step):
    for result in rehearse(recipe, layout=layout, ranks=ranks, step=step):
        _check(result.to_json(), step=step)
