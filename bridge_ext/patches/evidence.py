"""What proves each patch row is needed, and where its bug was reported upstream (docs/patches.md's last columns).

:data:`PROVEN_BY`: the test that fails on a stack where the row applies once the row is switched off
(``BRIDGE_EXT_PATCHES_OFF=<name>``, :func:`bridge_ext.patches.registry.switched_off`): the bug it works around,
reproduced. ``python tests/prove_patches.py`` runs each applying row's test with the row off and reports the rows
whose test still passes (upstream fixed the bug, or the test does not reach it). :data:`REPORTED`: the upstream
issue or pull request, or "not reported" (the fixes to send upstream). Rows of CPU mode's CUDA redirects
(``cuda-on-cpu <module>``) are proven by the CPU run that reaches their module (:func:`proven_by`).

tests/test_patches.py checks that every row has both. ``proofs.json`` (:func:`last_proven`) records, per row and
stack, the commit at which the prover last showed the row needed and the row's fingerprint then (its code and its
proving test); tests/test_patch_proofs.py fails when a row that applies on a stack has no current proof there.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["ATOMIC_SAVE", "FAILS_WITH", "NO_EXTENSION_POINT", "PROOFS", "PROVEN_BY", "REPORTED", "SWITCHED_WITH",
           "last_proven", "proven_by", "read_proofs", "reported"]

# The atomic save's rows (bridge_ext/patches/checkpointing.py), one per attribute.
ATOMIC_SAVE = ("atomic-checkpoint-save", "atomic-checkpoint-tracker", "atomic-checkpoint-train-state",
               "atomic-checkpoint-async-commit", "atomic-checkpoint-cleanup")

_TRAIN = "tests/test_cpu_training.py::test_pretrain_muon_decreases_loss"
_RESUME = "tests/test_cpu_training.py::test_resume_is_bit_exact"
_RNG = "tests/test_cpu_mode.py::test_cpu_rng_tracker_forks_and_restores"
_MODELS = "tests/test_cpu_mode.py::test_models_build_forward_and_backward"
_LAYOUTS = "tests/test_muon_layouts.py::test_one_muon_step_is_the_same_in_every_layout"
_PARALLEL = "tests/test_parallel_cpu.py::test_several_processes_compute_what_one_does_and_resume_in_any_layout"
_ADAMW_RESUME = "tests/test_parallel_cpu.py::test_adamw_resumes_at_dp2_as_it_ran_on"
_LAYER_WISE = ("tests/test_upstream_muon_bugs.py::"
               "test_layer_wise_muon_resumes_as_the_straight_run_and_loads_overridden_groups_under_pp")
_LEAKS = "tests/test_cpu_mode.py::test_training_runs_in_one_process_free_their_models_and_compile_nothing"
_KILLS = "tests/test_kill_safe.py::test_killed_at_every_stage_of_a_save_resumes_exactly"
_WRITER_KILLED = "tests/test_kill_safe.py::test_sigkilled_trainer_leaves_no_checkpoint_writer_process_behind"
_TIME_LIMIT = "tests/test_cpu_run_stops.py::test_a_time_limit_never_reached_trains_and_validates_every_iteration"
# a CPU run of the Moonlight proxy (MLA without a query low-rank)
_MOONLIGHT_RUN = "tests/test_initialization.py::test_redrawn_weights_have_upstreams_distributions[moonlight_proxy_muon]"
# the README's Python API script in a real process (Kimi K2 proxy: QK-clip, its max logit logged)
_README = "tests/test_python_api.py::test_the_readme_script_trains_a_proxy_with_megatron_bridges_pretrain"
_NAN_LOSS = "tests/test_cpu_run_stops.py::test_a_nan_loss_stops_the_run_with_megatrons_message"
_REHEARSE = "tests/test_rehearse.py::test_kimi_k2_last_rank_layer_wise_muon_equals_plan"
_KIMI_EXPORT = "tests/test_convert.py::test_kimi_export_reproduces_config_and_loads_into_deepseek_v3"
_LATENT_EPS = "tests/test_patches_needed.py::test_mla_latent_norm_eps_is_deepseek_v3s"
_SPLIT = "tests/test_muon_split.py::test_split_gate_up_matches_moonlight_on_the_hf_weights"
_NS = "tests/test_same_run_across_stacks.py::test_ns_coefficients_that_run"
_NONPOSITIVE = "tests/test_upstream_muon_bugs.py::test_qk_clip_leaves_a_head_with_a_nonpositive_max_logit_untouched"

PROVEN_BY: dict[str, str] = {
    "te-import-guard": "tests/test_cpu_mode.py::test_te_import_guard_keeps_te_absent",
    "peft-have-te": "tests/test_finetune.py::test_lora_trains_only_adapters_and_merged_export_matches_megatron",
    "muon-nesterov-kwarg": _NS,
    "muon-tp-mode-kwarg": _NS,
    "muon-ns-coefficients": _NS,
    "muon-ns-coefficients (emerging_optimizers)": _NS,
    "muon-gate-up-params": _SPLIT,
    "muon-gate-up-split": _SPLIT,
    "muon-gate-up-split (emerging_optimizers)": _SPLIT,
    "muon-clip-any-wrapper": _README,  # a real process: the same run inside pytest hung after the error
    "muon-lora-no-empty-adam": "tests/test_finetune.py::test_lora_trains_only_adapters_and_merged_export_matches_megatron",
    "muon-coefficient-types": _NS,
    "qk-clip-nonpositive-logit-mla": _NONPOSITIVE,
    "qk-clip-nonpositive-logit-gqa": ("tests/test_upstream_muon_bugs.py::"
                                      "test_qk_clip_as_it_runs_now_keeps_a_negative_head_on_mla_and_gqa"),
    "mla-latent-norm-eps": _LATENT_EPS,
    "mla-latent-norm-eps (conversion)": _LATENT_EPS,
    "mla-q-projection-without-norm": _MOONLIGHT_RUN,
    "mla-q-projection-without-norm (conversion)": _MOONLIGHT_RUN,
    "mla-rope-key-grad-tp": _LAYOUTS,
    "qk-clip-gqa-tp-shapes": "tests/test_muon_layouts.py::test_qk_clip_at_tp2_scales_each_query_group_as_one_process_does",
    "tp-weight-attributes-without-init": ("tests/test_tp_weight_attributes.py::"
                                          "test_the_hook_is_registered_exactly_where_the_installed_code_needs_it"),
    "prebuilt-dataset-helpers": "tests/test_patches.py::test_dataset_helpers_are_the_prebuilt_ones",
    "scheduler-warmup-cap": "tests/test_patches.py::test_a_short_run_caps_the_warm_up_on_every_stack",
    "validate-without-gpu": "tests/test_dry_run_stack.py::test_the_dry_run_names_the_stack_and_the_fixes_it_applies",
    "yaml-signal-target": "tests/test_build.py::test_yaml_round_trip_is_identical",
    "training-log-attention-logit": _README,  # a real process: the same run inside pytest hung after the error
    "sft-batches-in-dataset-order": "tests/test_finetune.py::test_finetuning_loaders_read_the_records_in_dataset_order",
    "sft-epochs-after-resume-from-the-start": ("tests/test_finetune.py::"
                                              "test_finetuning_loaders_read_the_records_in_dataset_order"),
    "manual-gc-restored": _LEAKS,
    "ddp-hook-cycle": _LEAKS,
    "atomic-checkpoint-save": _KILLS,
    "atomic-checkpoint-tracker": _KILLS,
    "atomic-checkpoint-train-state": _KILLS,
    "atomic-checkpoint-async-commit": _KILLS,
    "atomic-checkpoint-cleanup": _KILLS,
    "checkpoint-writer-dies-with-trainer": _WRITER_KILLED,
    "checkpoint-writer-dies-with-trainer (get_write_results_queue)": _WRITER_KILLED,
    "relayout-optimizer-load": _PARALLEL,
    "relayout-common-state": _PARALLEL,
    "relayout-common-state (load_common)": _PARALLEL,
    "param-group-identity": _LAYER_WISE,
    "deepseek-sequential-expert-mappings": ("tests/test_convert_stream.py::"  # Moonlight: DeepSeek-V3's bridge
                                            "test_streamed_export_equals_the_model_built_export_and_the_source"
                                            "[moonlight]"),
    "kimi-k2-bridge-mappings": _KIMI_EXPORT,
    "sequential-expert-export": _KIMI_EXPORT,
    "sequential-expert-numbers": "tests/test_convert_distributed.py::test_two_process_conversions_equal_one_process",
    "slurm-without-container": "tests/test_slurm.py::test_a_script_without_a_container_has_no_pyxis_flags",
    # CPU mode
    "jit-warmup": _LEAKS,  # compile time: the test asserts nothing is compiled
    "router-expert-bias-eager": _LEAKS,
    "clip-grads-fp32-check": _TRAIN,
    "clip-grads-fp32-check (imported name)": _TRAIN,
    "mla-have-te": _TRAIN,
    "rng-set": _RNG,  # the tracker forks a stream: it sets the "CUDA" state back
    "moe-te-general-gemm": _TRAIN,
    "mla-core-attention": _TRAIN,
    "tensor-cuda-stays-on-cpu": _TRAIN,
    "distrib-optimizer-cpu-types": _PARALLEL,
    "distrib-optimizer-fresh-state-dict": _ADAMW_RESUME,
    "distrib-optimizer-resumed-step": _ADAMW_RESUME,
    "distrib-optimizer-fp32-load": _ADAMW_RESUME,
    "layer-wise-all-gather-v": _LAYER_WISE,
    "layer-wise-fp32-members": _LAYER_WISE,
    "layer-wise-fp32-save": _LAYER_WISE,
    "torch-norm-sequence-parallel": _LAYOUTS,
    # rehearsals
    "fake-parameter-conversion": _REHEARSE,
    "fake-world-gather-object": _REHEARSE,
    "float16-optimizer-cpu-types": _REHEARSE,
    "local-l2-norm-fake": _REHEARSE,
    "fake-balanced-moe-dispatch": "tests/test_rehearse.py::test_proxy_micro_batch_fake_equals_real_and_hand_flops",
}

# Twin rows: the same change in two scopes (a conversion process applies the conversion scope, a run the stack
# scope, a test process both); each is proven with its twin off too.
SWITCHED_WITH: dict[str, tuple[str, ...]] = {
    # one mechanism in five attributes: the trackers staged by three rows are committed by the other two, so a row
    # off alone leaves the other half working on nothing (staged trackers never committed, or none to commit)
    **{name: tuple(other for other in ATOMIC_SAVE if other != name) for name in ATOMIC_SAVE},
    "mla-latent-norm-eps": ("mla-latent-norm-eps (conversion)",),
    "mla-latent-norm-eps (conversion)": ("mla-latent-norm-eps",),
    "mla-q-projection-without-norm": ("mla-q-projection-without-norm (conversion)",),
    "mla-q-projection-without-norm (conversion)": ("mla-q-projection-without-norm",),
    "clip-grads-fp32-check": ("clip-grads-fp32-check (imported name)",),
    "clip-grads-fp32-check (imported name)": ("clip-grads-fp32-check",),
    # one target (model_provider's torch) where megatron-bridge 0.3 keeps the DDP stream there
    "cuda-on-cpu megatron.bridge.models.model_provider": (
        "cuda-on-cpu megatron.bridge.models.model_provider (the DDP wrapping's stream)",),
    "cuda-on-cpu megatron.bridge.models.model_provider (the DDP wrapping's stream)": (
        "cuda-on-cpu megatron.bridge.models.model_provider",),
}

# The text a row's proving test fails with when the row is off: the upstream failure the row's ``why`` names, so
# that a failure for another reason does not count as the row's proof (tests/prove_patches.py: "fails otherwise").
FAILS_WITH: dict[str, str] = {
    "relayout-optimizer-load": "Cannot merge two lists",
    "relayout-common-state": "Cannot merge two lists",
    "relayout-common-state (load_common)": "Cannot merge two lists",
    # isinstance(m, <mock>) raises TypeError (Python's wording)
    "peft-have-te": "isinstance() arg 2 must be a type",
    "mla-have-te": "isinstance() arg 2 must be a type",
    "moe-te-general-gemm": "name 'te_general_gemm' is not defined",
    "mla-core-attention": "k_channels",
    # tests/test_cpu_mode.py's leak and compile checks say what each of these rows prevents
    "ddp-hook-cycle": "outlived its run",
    "jit-warmup": "torch.compile compiled a function on CPU",
    "router-expert-bias-eager": "torch.compile compiled a function on CPU",
}

# CPU mode's CUDA redirects by the run that reaches the module's CUDA code: checkpoint saves, TP with sequence
# parallelism and PP (the layouts test), several processes, a resume of the distributed optimizer, the time limit,
# a NaN loss, conversion; the rest by a training run
_REDIRECTS_BY_PREFIX: tuple[tuple[str, str], ...] = (
    ("megatron.core.dist_checkpointing.", _RESUME),
    ("megatron.bridge.training.checkpointing", _RESUME),
    ("megatron.core.pipeline_parallel.p2p_communication", _LAYOUTS),
    ("megatron.bridge.training.train", _TIME_LIMIT),
    ("megatron.bridge.training.eval", _TIME_LIMIT),
    ("megatron.core.rerun_state_machine", _NAN_LOSS),
    ("megatron.core.tensor_parallel.mappings", _LAYOUTS),
    ("megatron.core.optimizer.distrib_optimizer", _ADAMW_RESUME),
    ("megatron.core.optimizer.layer_wise_optimizer", _LAYER_WISE),
    ("megatron.bridge.models.conversion.param_mapping",
     "tests/test_convert_distributed.py::test_two_process_conversions_equal_one_process"),
    ("", _TRAIN),
)

REPORTED: dict[str, str] = {
    "qk-clip-nonpositive-logit-mla": "Megatron-LM PR 7382 (open)",
    "qk-clip-nonpositive-logit-gqa": "Megatron-LM PR 7382 (open)",
    "qk-clip-gqa-tp-shapes": "Megatron-LM issue 4646",
    "param-group-identity": "Megatron-LM issue 2625",
    "tp-weight-attributes-without-init": "not needed from megatron-core 0.18 (its else branch)",
    "slurm-without-container": "not needed from NeMo-Run 0.9 (`if container_image is None`)",
    "kimi-k2-bridge-mappings": "not needed from megatron-bridge 0.6 (its mappings)",
    "sequential-expert-numbers": "not needed from megatron-bridge 0.5 (read)",
    "sft-epochs-after-resume-from-the-start": "not needed from megatron-bridge 0.6 (its epoch-aware sampler)",
    "training-log-attention-logit": "not needed from megatron-bridge 0.6 (its keyword call)",
    "muon-coefficient-types": "not needed from megatron-core 0.18 with emerging-optimizers 0.2 (read)",
    "scheduler-warmup-cap": "not needed from megatron-bridge 0.4.2 (read)",
}


# Why each source rewrite (Patch.how) has no extension point to use instead (docs/patches.md lists them).
NO_EXTENSION_POINT: dict[str, str] = {
    "te-import-guard": "the unguarded `import transformer_engine.pytorch` runs when upstream's module is imported, "
                       "before any hook of ours can reach it; a stand-in `transformer_engine` in sys.modules would "
                       "make megatron-core's own `import transformer_engine` succeed and turn its TE paths on",
    "distrib-optimizer-cpu-types": "the CUDA type names are checked inline in DistributedOptimizer's "
                                   "_build_model_and_main_param_groups (about 100 lines), and get_megatron_optimizer "
                                   "builds the class by name: a subclass would copy the method",
    "layer-wise-fp32-save": "the loop is inline in LayerWiseDistributedOptimizer.sharded_state_dict, a class "
                            "megatron-core's Muon builder constructs by name: a subclass would copy the method",
    "float16-optimizer-cpu-types": "the CUDA type names are checked inline in Float16OptimizerWithFloat16Params."
                                   "__init__, which must run whole (it builds the fp32 main parameters)",
}


def proven_by(name: str) -> str | None:
    """The test that proves row ``name`` is needed (a pytest node id), or None when none is named."""
    if name in PROVEN_BY:
        return PROVEN_BY[name]
    if name.startswith("cuda-on-cpu "):
        module = name.removeprefix("cuda-on-cpu ").split(" ")[0]
        return next(test for prefix, test in _REDIRECTS_BY_PREFIX if module.startswith(prefix))
    return None


PROOFS = Path(__file__).with_name("proofs.json")


def read_proofs() -> dict[str, dict[str, dict[str, str]]]:
    """row -> stack -> ``{"commit", "fingerprint"}``: where each row was last shown needed (``proofs.json``,
    written by ``tests/prove_patches.py --record``)."""
    return json.loads(PROOFS.read_text())["rows"] if PROOFS.exists() else {}


def last_proven(name: str, proofs: dict[str, dict[str, dict[str, str]]]) -> str:
    """Where row ``name`` was last shown needed (``proofs``: :func:`read_proofs`): ``stack commit`` per stack, or
    "never"."""
    return ", ".join(f"{stack} {proof['commit']}" for stack, proof in proofs.get(name, {}).items()) or "never"


def reported(name: str) -> str:
    """Where the row's upstream bug is reported or fixed, or "not reported"."""
    return REPORTED.get(name, "not reported")
