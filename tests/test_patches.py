"""Every change to upstream behaviour (bridge_ext.patches): each patch fits the installed code or its condition
says it does not apply; each capability-decided patch applies exactly on the stacks that need it; drift is one
line and changes nothing; the fixes really change the calls they are for."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from bridge_ext import patches
from bridge_ext.patches import registry
from bridge_ext.patches.optimizer import renamed_kwarg
from bridge_ext.stack import UpstreamDrift, call_keywords, describe_stack, package_of, version_of
from bridge_ext.upstream_patch import Patch, always

pytestmark = pytest.mark.stack  # what differs between stacks: .ci/run runs these on every stack

REPO = Path(__file__).resolve().parent.parent

# The capability-decided patches (those with a needed() check) that apply on each lock, found by hand
# (megatron-core 0.16's Muon calls vs the installed emerging-optimizers' signatures; the PyPI megatron-core wheel
# ships no datasets Makefile). The others apply wherever their scope is used (CPU mode's in CPU mode).
# megatron-core 0.16-0.17 define TensorParallelMuon in optimizer/muon.py (0.18+: optimizer/emerging_optimizers.py)
MUON_IN_OPTIMIZER_MUON_PY = {"muon-ns-coefficients", "muon-gate-up-split"}
# megatron-core 0.16-0.18 match loaded param groups by (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr)
# (0.19 adds every override key): Megatron-LM issue 2625, tests/test_upstream_muon_bugs.py
PARAM_GROUPS_BY_FOUR_KEYS = {"param-group-identity"}
# megatron-bridge 0.3 exports SequentialMLP experts through int('') and keeps their local numbers under EP
# (0.4 reads local_experts.<N> on export, 0.6 also globalizes it; 0.4's KimiK2Bridge lacks their mappings)
SEQUENTIAL_EXPERTS_BEFORE_0_4 = {"sequential-expert-export", "sequential-expert-numbers"}
# megatron-bridge 0.3-0.4's deepseek/common.py maps only grouped-GEMM expert names (0.5 maps local_experts too)
DEEPSEEK_GROUPED_NAMES_ONLY = {"deepseek-sequential-expert-mappings"}
# megatron-core 0.16 without TE: MLA's own HAVE_TE is True (a mocked import), moe_utils binds te_general_gemm only
# in its TE try, the distributed optimizer's resume copies non-tensor state too (0.17 fixed all three)
CPU_FIXED_IN_CORE_0_17 = {"mla-have-te", "moe-te-general-gemm", "distrib-optimizer-fp32-load"}
# megatron-core 0.16-0.17's Muon builder chains an Adam part even when nothing is Adam's (LoRA with Muon)
EMPTY_ADAM_BEFORE_0_18 = {"muon-lora-no-empty-adam"}
# CPU mode's CUDA code where each release keeps it (bridge_ext.cpu.patches.moved: the DDP wrapping's stream in
# megatron-bridge 0.3's model_provider.py, megatron-core 0.19's megatron/training/models/dist_utils.py; the MoE
# tracker in 0.16 only)
CPU_CODE_IN_CORE_0_16 = {"cuda-on-cpu megatron.bridge.models.model_provider (the DDP wrapping's stream)",
                         "cuda-on-cpu megatron.core.transformer.moe.moe_utils (the MoE aux-loss tracker)"}
CPU_CODE_IN_CORE_0_19 = {"cuda-on-cpu megatron.training.models.dist_utils (the DDP wrapping's stream)",
                         # 0.19's layer-wise optimizer: fp32 members left raw
                         "layer-wise-fp32-members"}
# megatron-core 0.17 (MB 0.4): the DDP stream in megatron-bridge's models/common/unimodal.py, the MoE tracker
# still in moe_utils.py (tracker_num_layers), the per-rank all-gather buffers
CPU_CODE_IN_CORE_0_17 = {"cuda-on-cpu megatron.bridge.models.common.unimodal (the DDP wrapping's stream)",
                         "cuda-on-cpu megatron.core.transformer.moe.moe_utils (the MoE aux-loss tracker)"}
# megatron-core 0.17+ names the torch_dist writer's results-queue factory get_write_results_queue (a Manager still)
WRITER_QUEUE_PUBLIC = {"checkpoint-writer-dies-with-trainer (get_write_results_queue)"}
# megatron-core 0.17-0.18's dist_checkpointing.load reads the common state through load_common, 0.19's through
# load_common_state_dict (0.16: the common strategy it is handed)
COMMON_STATE_LOAD_COMMON = {"relayout-common-state (load_common)"}
COMMON_STATE_LOAD_COMMON_STATE_DICT = {"relayout-common-state"}
MLA_Q_WITHOUT_LORA = {f"mla-q-projection-without-norm{scope}" for scope in ("", " (conversion)")}
# megatron-core 0.16-0.17 set a TP layer's weight attributes only under perform_initialization (0.18 added the
# else branch): tests/test_tp_weight_attributes.py
TP_WEIGHT_ATTRIBUTES_ONLY_WITH_INIT = {"tp-weight-attributes-without-init"}
# megatron-bridge 0.3-0.5's fine-tuning batch sampler starts every epoch at the resume offset (0.6 fixed it)
SFT_RESUME_OFFSET_EVERY_EPOCH = {"sft-epochs-after-resume-from-the-start"}
APPLIES_BY_STACK = {  # (megatron-bridge, emerging-optimizers) of each requirements/lock-*.txt -> patches
    # 26.02 container: 0.16's Muon calls already match emerging-optimizers 0.1.0; MB 0.3.0 does not cap
    # NeMo-Run 0.8.0 writes pyxis flags without a container image (0.9.0 writes --chdir)
    ("0.3.0", "0.1.0"): {"prebuilt-dataset-helpers", "scheduler-warmup-cap", "checkpoint-writer-dies-with-trainer",
                         "slurm-without-container",
                         *MUON_IN_OPTIMIZER_MUON_PY, *PARAM_GROUPS_BY_FOUR_KEYS, *SEQUENTIAL_EXPERTS_BEFORE_0_4,
                         *DEEPSEEK_GROUPED_NAMES_ONLY, *CPU_FIXED_IN_CORE_0_17, *EMPTY_ADAM_BEFORE_0_18,
                         *CPU_CODE_IN_CORE_0_16, *SFT_RESUME_OFFSET_EVERY_EPOCH, *TP_WEIGHT_ATTRIBUTES_ONLY_WITH_INIT},
    # 26.04.01: megatron-core 0.17 still defines Muon in muon.py, checks the coefficient set (only 'quintic' with
    # emerging-optimizers 0.1.0), matches param groups by four keys; MB 0.4's KimiK2Bridge lacks the
    # SequentialMLP and expert-bias mappings, local expert numbers stay local (its export reads local_experts.<N>)
    ("0.4.2", "0.1.0"): {"prebuilt-dataset-helpers", "muon-coefficient-types", "kimi-k2-bridge-mappings",
                         "sequential-expert-numbers", *MUON_IN_OPTIMIZER_MUON_PY, *PARAM_GROUPS_BY_FOUR_KEYS,
                         *DEEPSEEK_GROUPED_NAMES_ONLY, *EMPTY_ADAM_BEFORE_0_18,
                         *CPU_CODE_IN_CORE_0_17, *WRITER_QUEUE_PUBLIC, "yaml-signal-target", *COMMON_STATE_LOAD_COMMON,
                         *SFT_RESUME_OFFSET_EVERY_EPOCH, *TP_WEIGHT_ATTRIBUTES_ONLY_WITH_INIT},
    # 26.06.01: megatron-core 0.18 moved Muon to emerging_optimizers.py and keeps 0.19's CPU-mode code homes
    # (the DDP stream in megatron/training/models/dist_utils.py, per-rank all-gather buffers, fp32 layer-wise
    # members), but still matches param groups by four keys; MB 0.5's KimiK2Bridge lacks the expert mappings;
    # MB 0.5's train.py passes the max attention logit where 0.5's training_log takes pg_collection
    ("0.5.1", "0.2.0"): {"prebuilt-dataset-helpers", "kimi-k2-bridge-mappings", "layer-wise-fp32-members",
                         "training-log-attention-logit",
                         *{f"{name} (emerging_optimizers)" for name in MUON_IN_OPTIMIZER_MUON_PY},
                         "cuda-on-cpu megatron.training.models.dist_utils (the DDP wrapping's stream)",
                         *PARAM_GROUPS_BY_FOUR_KEYS, *COMMON_STATE_LOAD_COMMON,
                         *WRITER_QUEUE_PUBLIC, *SFT_RESUME_OFFSET_EVERY_EPOCH},
    # 26.08: megatron-core 0.19 calls emerging-optimizers with its own names (no kwarg fix), checks the coefficient
    # set against it, matches param groups by every override key; MB 0.6's KimiK2Bridge maps SequentialMLP experts
    # megatron-core 0.19's QKNormConfigResolver fuses a norm into linear_q_proj without a query low-rank (Moonlight)
    # and refuses the local spec's unused q_layernorm
    # MB 0.6's fine-tuning batch sampler reshuffles every epoch unless told not to (data/samplers.py)
    ("0.6.0", "0.2.0"): {"prebuilt-dataset-helpers", *MLA_Q_WITHOUT_LORA, *{f"{name} (emerging_optimizers)" for name in
                                                       MUON_IN_OPTIMIZER_MUON_PY}, *CPU_CODE_IN_CORE_0_19,
                         *WRITER_QUEUE_PUBLIC, "sft-batches-in-dataset-order", *COMMON_STATE_LOAD_COMMON_STATE_DICT},
}
# newest (megatron-bridge 0.6.2, megatron-core 0.19.2, emerging-optimizers 0.3.0): the same code as 26.08 for every
# capability-decided patch (0.19.2's Muon passes emerging-optimizers 0.3.0's names itself)
APPLIES_BY_STACK[("0.6.2", "0.3.0")] = APPLIES_BY_STACK[("0.6.0", "0.2.0")]
# ... and on every stack, on these machines (no GPU, no Transformer Engine)
APPLIES_ON_THIS_MACHINE = {"te-import-guard", "peft-have-te", "validate-without-gpu",
                           "local-l2-norm-fake",  # clip_grads' local l2 norm: no TE, no apex
                           # the distributed optimizer's resume with torch's Adam (no TE, no apex)
                           "distrib-optimizer-fresh-state-dict", "distrib-optimizer-resumed-step"}
# ... and on every release read (megatron-core 0.16.0-0.19.2: Megatron-LM PR 7382 unmerged; probed, not assumed:
# tests/test_upstream_muon_bugs.py)
APPLIES_ON_EVERY_RELEASE_READ = {"qk-clip-nonpositive-logit-mla", "qk-clip-nonpositive-logit-gqa",
                                 # GQA QK-clip's shape error at TP > 1 (Megatron-LM issue 4646; 0.16.0, 0.17.1,
                                 # 0.19.2 read; probed: tests/test_muon_layouts.py)
                                 "qk-clip-gqa-tp-shapes",
                                 # MLA's shared rotary key without TP-summed gradient (no TE; 0.16.0, 0.17.1, 0.19.2)
                                 "mla-rope-key-grad-tp",
                                 # megatron-core 0.16-0.19 build MLA's latent norms with layernorm_epsilon
                                 "mla-latent-norm-eps", "mla-latent-norm-eps (conversion)",
                                 # rehearsals (nemo llm rehearse): torch 2.10-2.14's Module._apply swaps fake
                                 # parameters (probed); megatron-core 0.16-0.19's Float16 optimizer takes CUDA types only
                                 "fake-parameter-conversion", "float16-optimizer-cpu-types",
                                 # megatron-bridge 0.3-0.6's train() leaves the collector off under manual_gc;
                                 # megatron-core 0.16-0.19's DDP gradient hooks hold the wrapper (a cycle through
                                 # C++): tests/test_cpu_mode.py counts the models alive after runs
                                 "manual-gc-restored", "ddp-hook-cycle"}


def test_every_patch_fits_the_installed_code_or_does_not_apply(capsys):
    rows = patches.table()
    with capsys.disabled():
        print(f"\n{describe_stack()}: {len(rows)} patches, {sum(r['applies here'] == 'yes' for r in rows)} apply")
        for row in rows:
            print(f"  {row['name']:48} {row['area']:13} {row['scope']:13} {row['applies here']:4} {row['target']}")
    assert patches.drift() == []
    assert len({p.name for p in patches.REGISTRY}) == len(patches.REGISTRY), "patch names are unique"
    for patch in patches.REGISTRY:
        assert patch.upstream and patch.why and patch.when and "\n" not in patch.upstream, patch.name


def test_each_stack_fix_applies_exactly_where_the_installed_code_needs_it():
    stack = (version_of("megatron-bridge"), version_of("emerging-optimizers"))
    decided = {p.name for p in patches.REGISTRY if p.needed is not always}
    expected = APPLIES_BY_STACK[stack] | APPLIES_ON_THIS_MACHINE | APPLIES_ON_EVERY_RELEASE_READ
    assert set(patches.applied_here()) & decided == expected, describe_stack()


def locked_stacks() -> dict[str, tuple[str, str]]:
    """STACK name -> (megatron-bridge, emerging-optimizers) as requirements/lock-<STACK>.txt pins them."""
    from prove_patches import locked_pins

    return {stack: (pins["megatron-bridge"], pins["emerging-optimizers"]) for stack, pins in locked_pins().items()}


def patches_by_stack_markdown() -> str:
    """docs/stacks.md's "Patches by stack" table: every capability-decided patch (registry order) by lock, from
    the expectations above that test_each_stack_fix_applies_exactly_where_the_installed_code_needs_it checks."""
    stacks = locked_stacks()
    everywhere = APPLIES_ON_THIS_MACHINE | APPLIES_ON_EVERY_RELEASE_READ
    lines = ["| patch | " + " | ".join(f"`{name}`" for name in stacks) + " |", "|---" * (len(stacks) + 1) + "|"]
    for patch in (p for p in patches.REGISTRY if p.needed is not always):
        cells = ["applies" if patch.name in APPLIES_BY_STACK[key] | everywhere else "—" for key in stacks.values()]
        lines.append(f"| {patch.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def test_every_lock_has_its_expected_patches():
    """APPLIES_BY_STACK names exactly the locked stacks: none untested, no entry for a stack no lock installs."""
    assert set(locked_stacks().values()) == set(APPLIES_BY_STACK)


@pytest.mark.once  # the same text on every stack
def test_the_stacks_doc_shows_the_patches_by_stack():
    text = (REPO / "docs" / "stacks.md").read_text()
    section = text.split("\n## Patches by stack\n", 1)[1].split("\n## ", 1)[0]
    table = "\n".join(line for line in section.splitlines() if line.startswith("|"))
    assert table == patches_by_stack_markdown(), (
        "paste the output of: python -c \"import sys; sys.path[:0] = ['tests']; import test_patches; "
        "print(test_patches.patches_by_stack_markdown())\"")


def test_the_docs_list_every_patch():
    text = (REPO / "docs" / "patches.md").read_text()
    assert all(f"| {p.name} |" in text for p in patches.REGISTRY), "run python -m bridge_ext.patches --markdown"
    if f"\"Here\": {describe_stack()}." in text:  # the stack that generated it: identical
        assert text == patches.markdown() + "\n", "run python -m bridge_ext.patches --markdown > docs/patches.md"


# --- drift: one line, nothing changed ----------------------------------------------------------------------


def _fake(name: str, **changes) -> Patch:
    fields = dict(name=name, area="cpu", scope="cpu", module="megatron.core.timers", attr="torch", upstream="u",
                  why="w", make=lambda old: pytest.fail("patched despite drift"))
    return Patch(**{**fields, **changes})


def test_drift_refuses_in_one_line_and_applies_nothing(monkeypatch):
    import megatron.core.timers as timers

    before = timers.torch
    drifted = (_fake("drifted-snippet", snippets=("torch.cuda.no_such_call()",)),
               _fake("vanished-target", attr="no_such_attribute"),
               _fake("fits", snippets=("torch.cuda.synchronize()",)))
    monkeypatch.setattr(registry, "REGISTRY", drifted)
    with pytest.raises(UpstreamDrift) as raised:
        patches.apply("cpu")
    version = metadata.version("megatron-core")
    assert str(raised.value) == (f"CPU mode does not fit the installed code: megatron-core {version}: "
                                 "megatron.core.timers no longer contains 'torch.cuda.no_such_call()' "
                                 "(drifted-snippet) (and 1 more; tests/test_patches.py lists them)")
    assert timers.torch is before and not {"drifted-snippet", "vanished-target", "fits"} & set(patches.applied())
    assert patches.drift() == [
        f"megatron-core {version}: megatron.core.timers no longer contains 'torch.cuda.no_such_call()' "
        "(drifted-snippet)",
        f"megatron-core {version}: megatron.core.timers.no_such_attribute is gone (vanished-target)",
    ]


def _replace(monkeypatch, name: str, **changes) -> Patch:
    """The registry with patch ``name`` changed as drift would change it; returns the original."""
    original = next(p for p in patches.REGISTRY if p.name == name)
    monkeypatch.setattr(registry, "REGISTRY", tuple(dataclasses.replace(p, **changes) if p is original else p
                                                    for p in patches.REGISTRY))
    return original


def test_drift_in_a_cuda_redirect_is_reported(monkeypatch):
    _replace(monkeypatch, "cuda-on-cpu megatron.core.timers", snippets=("torch.cuda.no_such_call()",))
    assert patches.drift() == [f"megatron-core {metadata.version('megatron-core')}: megatron.core.timers no longer "
                               "contains 'torch.cuda.no_such_call()' (cuda-on-cpu megatron.core.timers)"]


def test_drift_in_an_attribute_patch_is_reported(monkeypatch):
    patch = next(p for p in patches.REGISTRY if p.scope == "cpu" and p.attr != "torch" and p.snippets)
    _replace(monkeypatch, patch.name, snippets=(patch.snippets[0] + "  # changed",))
    problems = patches.drift()
    assert len(problems) == 1 and patch.name in problems[0] and patch.module in problems[0]


def test_a_vanished_attribute_is_reported(monkeypatch):
    import importlib

    patch = next(p for p in patches.REGISTRY if p.scope == "cpu" and p.must_exist and p.attr != "torch"
                 and "." not in p.attr)
    monkeypatch.delattr(importlib.import_module(patch.module), patch.attr)
    assert any(f"{patch.target} is gone ({patch.name})" in p for p in patches.drift())


def test_every_cpu_target_is_code_that_needs_the_patch():
    """A redirect is only justified by CUDA code in that module, or a collective gloo cannot run as NCCL does (the
    layer-wise optimizer's all-gather of uneven sizes); a .cuda() caller by a .cuda( call."""
    from bridge_ext.cpu import patches as cpu

    for patch in (p for p in patches.REGISTRY if p.scope == "cpu"):
        if patch.attr == "torch":  # a one_of snippet: each of its forms
            forms = [form for code in patch.snippets for form in ((code,) if isinstance(code, str) else code)]
            assert forms and all("cuda" in code or "nccl" in code or "torch.distributed.all_gather(" in code
                                 for code in forms), patch.name
        elif patch.target == "torch.Tensor.cuda":
            assert patch.elsewhere == tuple(cpu.TENSOR_CUDA_CALLERS.items())
            assert all(".cuda(" in code for _, snippets in patch.elsewhere for code in snippets)
        else:
            assert patch.snippets, patch.name


def test_a_capability_check_that_meets_unknown_code_is_drift(monkeypatch):
    def unknown() -> bool:
        raise UpstreamDrift("emerging-optimizers 9.9: newton_schulz_tp takes neither mode= nor tp_mode=")

    monkeypatch.setattr(registry, "REGISTRY", (_fake("unknown-shape", scope="stack", needed=unknown),))
    with pytest.raises(UpstreamDrift, match="^emerging-optimizers 9.9: newton_schulz_tp"):
        patches.apply("stack")
    assert patches.drift() == ["emerging-optimizers 9.9: newton_schulz_tp takes neither mode= nor tp_mode= "
                               "(unknown-shape)"]
    assert patches.table()[0]["applies here"].startswith("drift: emerging-optimizers 9.9")


def test_drift_reaches_the_user_as_one_line_and_exit_2(tmp_path):
    """A stack fix that meets unknown code stops `nemo llm pretrain` with one line, no traceback."""
    script = (
        "import sys\n"
        "from bridge_ext import commands\n"
        "from bridge_ext.patches import Patch, registry\n"
        "from bridge_ext.stack import UpstreamDrift\n"
        "def drifted():\n"
        "    raise UpstreamDrift('emerging-optimizers 9.9: newton_schulz_tp takes neither mode= nor tp_mode=')\n"
        "registry.REGISTRY = (*registry.REGISTRY, Patch(name='x', area='optimizer', scope='stack', module='sys',\n"
        "                     attr='path', upstream='u', why='w', needed=drifted, make=lambda old: old))\n"
        "sys.exit(commands.main(sys.argv[1:]))\n"
    )
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "-c", script, "llm", "pretrain", "--recipe", "qwen3_proxy_muon",
                             "--device", "cpu", f"checkpoint.save={out}", "train.train_iters=1"],
                            capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith("error: emerging-optimizers 9.9")
    assert "Traceback" not in result.stderr and not out.exists()


def test_temporarily_restores_upstream():
    from megatron.bridge.training import config as mb_config

    original = mb_config.validate_flex_dispatcher_backend
    with patches.temporarily("dryrun") as names:
        assert names == ("validate-without-gpu",)  # these machines have no GPU
        assert mb_config.validate_flex_dispatcher_backend(object()) is None
    assert mb_config.validate_flex_dispatcher_backend is original


# --- stack fixes: what they change ----------------------------------------------------------------------------


def test_a_short_run_caps_the_warm_up_on_every_stack():
    """lr_warmup_iters 40 with 10 iterations: warm-up capped to decay - 1 (megatron-bridge 0.3.1's rule),
    so megatron-core's scheduler accepts it, instead of asserting at launch."""
    import recipes
    from bridge_ext.build import build_config

    patches.apply("stack")
    cfg = build_config(recipes.get_recipe("qwen3_proxy_muon"))
    cfg.train.train_iters, cfg.scheduler.lr_warmup_iters, cfg.scheduler.lr_warmup_fraction = 10, 40, None
    cfg.scheduler.lr_decay_iters = None
    cfg._calculate_scheduler_steps()
    gbs = cfg.train.global_batch_size
    assert cfg.scheduler.lr_decay_steps == 10 * gbs and cfg.scheduler.lr_warmup_steps == 10 * gbs - 1


def _tensor_parallel_muon():
    """(module, class): megatron-core's TensorParallelMuon where the installed release defines it,
    optimizer/muon.py (0.16-0.17) or optimizer/emerging_optimizers.py (0.18+)."""
    import importlib
    import importlib.util

    for name in ("megatron.core.optimizer.muon", "megatron.core.optimizer.emerging_optimizers"):
        if importlib.util.find_spec(name) is not None:
            cls = getattr(importlib.import_module(name), "TensorParallelMuon", None)
            if cls is not None and cls.__module__ == name:
                return name, cls
    raise AssertionError(f"no TensorParallelMuon in {package_of('megatron.core')}")


def _muon_with_own_names(params, *, momentum: float, nesterov: bool, tp_mode: str, **kwargs):
    """TensorParallelMuon built with the installed megatron-core's own keywords (0.16: momentum_beta=,
    use_nesterov=, mode=; 0.18+: momentum=, nesterov=, tp_mode=)."""
    from bridge_ext.stack import signature_params

    cls = _tensor_parallel_muon()[1]
    names = signature_params(cls.__init__)

    def own(*candidates: str) -> str:
        return next(name for name in candidates if name in names)

    return cls(params, **{own("momentum_beta", "momentum"): momentum, own("use_nesterov", "nesterov"): nesterov,
                          own("mode", "tp_mode"): tp_mode}, **kwargs)


def test_megatron_core_call_sites_are_read_from_its_source():
    from bridge_ext.stack import module_source

    module = _tensor_parallel_muon()[0]
    if '{"tp_mode": mode_value} if HAVE_EO_V02 else {"mode": mode_value}' in module_source(module):
        # megatron-core 0.17 picks emerging-optimizers' names itself (keyword dicts): no literal keyword for the
        # kwarg fixes to find, so neither applies
        assert not {"mode", "tp_mode"} & call_keywords(module, "newton_schulz_tp")
        assert not {"use_nesterov", "nesterov"} & call_keywords(module, "__init__", inside="TensorParallelMuon")
        assert not {"muon-nesterov-kwarg", "muon-tp-mode-kwarg"} & set(patches.applied_here())
        return
    mode, nesterov = ("mode", "use_nesterov") if module.endswith(".muon") else ("tp_mode", "nesterov")
    assert mode in call_keywords(module, "newton_schulz_tp")
    assert nesterov in call_keywords(module, "__init__", inside="TensorParallelMuon")


def test_muon_steps_with_megatron_cores_own_arguments(cpu_mode):
    """After the fixes (applied or skipped), megatron-core's Muon runs one step on every stack."""
    import torch

    weight = torch.nn.Parameter(torch.eye(4) * 2.0)
    opt = _muon_with_own_names([weight], lr=0.5, momentum=0.0, nesterov=False, weight_decay=0.0,
                               num_ns_steps=5, scale_mode="shape_scaling", tp_mode="duplicated")
    weight.grad = torch.eye(4)
    opt.step()
    # a gradient that is already orthogonal: Newton-Schulz keeps (approximately) its direction, so the
    # diagonal moves by ~lr and the off-diagonal stays 0 (quintic coefficients land within 0.7-1.2)
    diagonal = torch.diagonal(weight.detach())
    assert torch.all((diagonal > 2.0 - 0.5 * 1.2) & (diagonal < 2.0 - 0.5 * 0.7))
    assert torch.count_nonzero(weight.detach() - torch.diag(diagonal)) == 0


def test_muon_stack_fix_passes_nesterov_and_tp_mode_through(cpu_mode):
    import math

    import torch

    weight = torch.nn.Parameter(torch.randn(16, 8, generator=torch.Generator().manual_seed(0)))
    # coefficient_type explicit: a recipe trained earlier in this process installed its preset's set as the default
    opt = _muon_with_own_names([weight], lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.0,
                               num_ns_steps=5, scale_mode="spectral", tp_mode="blockwise", coefficient_type="quintic")
    assert getattr(opt, "nesterov", getattr(opt, "use_nesterov", None)) is True  # 0.3.0 / 0.1.0 name
    weight.grad = torch.ones_like(weight)
    before = weight.detach().clone()
    opt.step()
    assert torch.equal(opt.state[weight]["momentum_buffer"], 0.1 * torch.ones_like(weight))
    update = (before - weight.detach()) / 0.1
    # an orthogonalized rank-1 update: one singular value, scaled by sqrt(max(rows, cols)) ("spectral"). Its
    # normalized singular value 1 goes through modded-nanogpt's five "quintic" polynomials a s + b s^3 + c s^5
    sigma = 1.0
    for a, b, c in ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                    (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)):
        sigma = a * sigma + b * sigma**3 + c * sigma**5
    singular = torch.linalg.svdvals(update)
    assert singular[0] == pytest.approx(math.sqrt(16) * sigma, rel=2e-3) and singular[1] < 1e-3 * singular[0]


def test_dataset_helpers_are_the_prebuilt_ones(cpu_mode):
    import importlib

    initialize = importlib.import_module("megatron.bridge.training.initialize")
    initialize.compile_helpers()  # would run `make` and sys.exit(1) upstream
    assert importlib.import_module("megatron.core.datasets.helpers_cpp").build_sample_idx_int32


def test_muon_over_lora_chains_only_the_parts_that_hold_parameters():
    """LoRA trains only matrices (A, B): megatron-core's Adam part wraps None and would fail the first save."""
    from types import SimpleNamespace

    patch = next(p for p in patches.REGISTRY if p.name == "muon-lora-no-empty-adam")
    muon, empty = SimpleNamespace(optimizer=object()), SimpleNamespace(optimizer=None)
    build = patch.make(lambda *args, **kwargs: SimpleNamespace(chained_optimizers=[muon, empty]))
    assert build("config", ["chunk"]).chained_optimizers == [muon]
    adam = SimpleNamespace(optimizer=object())
    full = patch.make(lambda *args, **kwargs: SimpleNamespace(chained_optimizers=[muon, adam]))
    assert full().chained_optimizers == [muon, adam]  # nothing empty: unchanged


def _callee_without(*names):
    def callee(self, params):  # takes neither of the renamed keywords
        return None

    return callee


def test_a_renamed_keyword_with_no_known_name_is_one_line_of_drift():
    with pytest.raises(UpstreamDrift) as raised:
        renamed_kwarg(frozenset({"use_nesterov"}), _callee_without(), old="use_nesterov", new="nesterov",
                      what="OrthogonalizedOptimizer.__init__")
    message = str(raised.value)
    assert "\n" not in message and "megatron-core " + metadata.version("megatron-core") in message
    assert "neither use_nesterov= nor nesterov=" in message


def test_renamed_keyword_decisions():
    def old_style(*, use_nesterov):
        return None

    def new_style(*, nesterov):
        return None

    passes = frozenset({"use_nesterov"})
    assert renamed_kwarg(passes, old_style, old="use_nesterov", new="nesterov", what="f") is False
    assert renamed_kwarg(passes, new_style, old="use_nesterov", new="nesterov", what="f") is True
    assert renamed_kwarg(frozenset(), new_style, old="use_nesterov", new="nesterov", what="f") is False


def test_package_of_names_the_installed_version():
    assert package_of("megatron.bridge.training.config") == f"megatron-bridge {metadata.version('megatron-bridge')}"
    assert package_of("emerging_optimizers.x") == f"emerging-optimizers {metadata.version('emerging-optimizers')}"


# --- the import graph -------------------------------------------------------------------------------------------


def _module_imports(path: Path) -> set[str]:
    """bridge_ext modules a file imports (at any depth: function-level imports count too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bridge_ext."):
            names.add(node.module.split(".")[1])
        elif isinstance(node, ast.ImportFrom) and node.module == "bridge_ext":
            names.update(alias.name for alias in node.names)
    return names


# The packages and modules whose behaviour patches wire in (their rows in bridge_ext/patches point at them).
WIRED_IN = {"muon", "cpu", "without_te", "checkpoints", "kill_safe", "relayout"}


def test_no_import_cycles_between_our_modules():
    package = REPO / "bridge_ext"
    graph = {path.stem: _module_imports(path) - {path.stem} for path in package.glob("*.py") if path.stem != "__init__"}
    for init in package.glob("*/__init__.py"):  # a subpackage is one node: what any of its files imports
        files = init.parent.rglob("*.py")
        graph[init.parent.name] = set().union(*map(_module_imports, files)) - {init.parent.name}
    assert graph["stack"] <= {"errors"}  # the ground floor
    assert graph["patches"] <= {"upstream_patch", "stack", "errors", *WIRED_IN}, graph["patches"]  # below their users
    # a package whose behaviour patches wire in switches its own rows on through bridge_ext.upstream_patch, never importing
    # bridge_ext.patches (tests/test_layering.py): no edge back, no exemption

    def visit(node, trail):
        assert node not in trail, " -> ".join([*trail, node])
        for nxt in graph.get(node, ()):
            visit(nxt, (*trail, node))

    for module in graph:
        visit(module, ())


def test_a_patch_file_is_one_area():
    """The area is the file's (docs/patches.md groups by it): every row a module of the registry declares (CPU
    mode's: bridge_ext/cpu/patches) has the same area, and the modules hold every registered patch."""
    files = {table.__name__.lstrip("_"): table() for table in registry.TABLES_IN_ORDER}
    assert sorted(p.name for rows in files.values() for p in rows) == sorted(p.name for p in patches.REGISTRY)
    areas = {name: {p.area for p in rows} for name, rows in files.items()}
    assert all(len(area) == 1 for area in areas.values()), areas
    assert areas["transformer"] == {"transformer"} and areas["checkpointing"] == {"checkpointing"}
    assert areas["conversion"] == {"conversion"} and areas["cpu"] == {"cpu"}
    assert areas["without_te"] == {"without-te"}


def test_a_moved_class_is_found_in_its_installed_home_or_named_as_drift():
    """``stack.first_defined``: the first home that defines the name wins; none is one line naming every home."""
    import json.decoder

    from bridge_ext.stack import UpstreamDrift, first_defined

    assert first_defined("JSONDecoder", "json.no_such_module", "json.decoder") is json.decoder.JSONDecoder
    assert first_defined("JSONDecoder", "no_such_package.sub", "json") is json.decoder.JSONDecoder
    with pytest.raises(UpstreamDrift) as info:
        first_defined("NoSuchClass", "json", "json.decoder")
    assert str(info.value).count("\n") == 0 and "json, json.decoder" in str(info.value)


def test_each_scope_loads_the_tables_that_hold_its_rows():
    """registry.TABLES, which a process follows to import only the tables of the scopes it applies, names for every
    row the table that holds it."""
    from bridge_ext.patches import registry

    owner = {id(row): table for table in registry.TABLES_IN_ORDER for row in table()}
    assert len(owner) == len(patches.REGISTRY)
    misplaced = [(p.name, p.scope) for p in patches.REGISTRY if owner[id(p)] not in registry.TABLES.get(p.scope, ())]
    assert misplaced == [], "add their tables to registry.TABLES"


HARNESS = ("bridge_ext.cpu", "bridge_ext.rehearse", "bridge_ext.patches.rehearse")
# What each GPU-side entry reaches with the GPU decision forced on this CPU-only machine (tests/gpu_side_probe.py):
# completed, or its first CUDA call (the device decision, its config and its patches all behind it).
GPU_SIDE_ENTRIES = {
    "import": "reached the GPU", "import --no-stream": "reached the GPU",
    "pretrain --dryrun": "completed", "pretrain --to-yaml": "completed",
    "finetune --dryrun": "completed", "finetune --to-yaml": "completed",
    "api prepare_for_this_machine": "completed", "every scope a GPU run applies": "completed",
    "export": "reached the GPU", "export --no-stream": "reached the GPU",
    "evaluate": "reached the GPU", "generate": "reached the GPU",
}


@pytest.mark.slow
def test_the_gpu_path_carries_no_cpu_harness_and_no_rehearsal(tmp_path):
    """Every GPU-side entry (issue 49: ``pretrain``/``finetune`` ``--dryrun`` and ``--to-yaml`` with ``--device
    gpu``, the Python API's preparation, ``import`` and ``export`` both ways, ``evaluate``, ``generate``, and every
    scope a GPU run applies) loads no module of bridge_ext/cpu or bridge_ext/rehearse and no rehearsal patch table.
    The GPU decision is forced by answering ``torch.cuda.is_available()`` (and the device's properties) as one H100
    would (tests/gpu_side_probe.py); the control, the same machine's CPU import, loads CPU mode."""
    import json

    import hf_fixtures

    hf = hf_fixtures.qwen3_dir(tmp_path / "hf")
    done = subprocess.run([sys.executable, str(REPO / "tests" / "gpu_side_probe.py"), str(tmp_path), str(hf)],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = {r["entry"]: r for r in map(json.loads, (tmp_path / "reports.jsonl").read_text().splitlines())}
    control = reports.pop("import on this machine's CPU (the control)")
    assert "bridge_ext.cpu.mode" in control["loaded"]  # the check sees CPU mode where it is taken
    assert {name: r["outcome"] for name, r in reports.items()} == GPU_SIDE_ENTRIES, \
        {name: r.get("error", "")[-1500:] for name, r in reports.items() if r["outcome"] != GPU_SIDE_ENTRIES.get(name)}
    assert "bridge_ext.patches.optimizer" in reports["every scope a GPU run applies"]["loaded"]
    harness = {name: [m for m in r["loaded"] if m.startswith(HARNESS)] for name, r in reports.items()}
    assert harness == {name: [] for name in reports}, harness


def test_source_rewrites_are_few_and_none_is_on_the_gpu_path():
    """Issue 39: where upstream offers an extension point a row uses it (pre-wrap hooks, subclasses, stand-ins);
    the rows that still recompile upstream text are at most 5, and none applies where a GPU run applies rows
    (CPU mode, rehearsals and the import guard only without Transformer Engine, which every container has)."""
    rewrites = {p.name: p for p in patches.REGISTRY if p.how == "source rewrite"}
    assert len(rewrites) <= 5, sorted(rewrites)
    gpu_scopes = {"stack", "muon", "lora", "lora-muon", "checkpointing", "conversion", "config", "launch"}
    assert not [name for name, p in rewrites.items() if p.scope in gpu_scopes]
    assert all(p.scope in ("cpu", "rehearse") or "Transformer Engine is not installed" in p.when
               for p in rewrites.values()), sorted(rewrites)
    from bridge_ext.patches import evidence

    assert set(evidence.NO_EXTENSION_POINT) == set(rewrites), "each rewrite says why no extension point fits"
    text = (REPO / "docs" / "patches.md").read_text()
    assert f"Source rewrites: {len(rewrites)} in all" in text


@pytest.mark.once  # the same table on every stack
def test_every_row_names_the_test_that_proves_it_and_where_it_was_reported():
    """bridge_ext/patches/evidence.py: each row's proving test exists (tests/prove_patches.py runs it with the row
    off), and each row says where its bug was reported upstream, or that it was not."""
    import re

    from bridge_ext.patches import evidence

    assert set(evidence.PROVEN_BY) <= {p.name for p in patches.REGISTRY}, "evidence for a row that does not exist"
    for patch in patches.REGISTRY:
        test = evidence.proven_by(patch.name)
        assert test, f"{patch.name}: no proving test in bridge_ext/patches/evidence.py"
        path, function = test.split("::")
        function = function.split("[")[0]  # a parametrized test's case: the function holds it
        source = (REPO / path).read_text()
        assert re.search(rf"^def {re.escape(function)}\(", source, re.MULTILINE), test
        assert evidence.reported(patch.name)


def test_a_switched_off_row_is_not_applied(monkeypatch):
    """BRIDGE_EXT_PATCHES_OFF leaves the named rows out of apply (how tests/prove_patches.py shows a row needed)."""
    from bridge_ext.patches.registry import SWITCH_OFF_ENV

    monkeypatch.setattr(registry, "REGISTRY", (_fake("off-row", scope="stack", make=lambda old: "patched"),))
    monkeypatch.setenv(SWITCH_OFF_ENV, "other, off-row")
    assert patches.apply("stack") == ()
