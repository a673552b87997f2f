"""Stack fixes by capability: each applies exactly where the installed code needs it, on every stack CI runs;
an unknown upstream shape is one line naming the package and its version."""

from __future__ import annotations

import ast
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from bridge_ext import compat
from bridge_ext.stack import UpstreamDrift, describe_stack, package_of, version_of

pytestmark = pytest.mark.stack  # the stack differences module: .ci/run runs these on every stack

REPO = Path(__file__).resolve().parent.parent

# What each lock needs, found by hand on each stack (megatron-core 0.16's Muon calls vs the installed
# emerging-optimizers' signatures; the PyPI megatron-core wheel ships no datasets Makefile).
FIXES_BY_STACK = {  # (megatron-bridge, emerging-optimizers) -> fixes
    ("0.3.1", "0.3.0"): {"muon-nesterov-kwarg", "muon-tp-mode-kwarg", "prebuilt-dataset-helpers"},  # lock-26.02
    # lock-26.02-container: 0.16's Muon calls already match emerging-optimizers 0.1.0; MB 0.3.0 does not cap
    ("0.3.0", "0.1.0"): {"prebuilt-dataset-helpers", "scheduler-warmup-cap"},
}


def test_each_fix_applies_exactly_where_the_installed_code_needs_it():
    needed = {fix.name for fix in compat.STACK_FIXES if fix.needed()}
    stack = (version_of("megatron-bridge"), version_of("emerging-optimizers"))
    assert needed == FIXES_BY_STACK[stack], describe_stack()


def test_a_short_run_caps_the_warm_up_on_every_stack():
    """lr_warmup_iters 40 with 10 iterations: warm-up capped to decay - 1 (megatron-bridge 0.3.1's rule),
    so megatron-core's scheduler accepts it, instead of asserting at launch."""
    import recipes
    from bridge_ext.build import build_config

    compat.apply_stack_fixes()
    cfg = build_config(recipes.get_recipe("qwen3_proxy_muon"))
    cfg.train.train_iters, cfg.scheduler.lr_warmup_iters, cfg.scheduler.lr_warmup_fraction = 10, 40, None
    cfg.scheduler.lr_decay_iters = None
    cfg._calculate_scheduler_steps()
    gbs = cfg.train.global_batch_size
    assert cfg.scheduler.lr_decay_steps == 10 * gbs and cfg.scheduler.lr_warmup_steps == 10 * gbs - 1


def test_megatron_core_call_sites_are_read_from_its_source():
    assert "mode" in compat.call_keywords("megatron.core.optimizer.muon", "newton_schulz_tp")
    assert "use_nesterov" in compat.call_keywords("megatron.core.optimizer.muon", "__init__",
                                                  inside="TensorParallelMuon")


def test_muon_steps_with_megatron_cores_own_arguments(cpu_mode):
    """After the fixes (applied or skipped), megatron-core's Muon runs one step on either stack."""
    import torch
    from megatron.core.optimizer.muon import TensorParallelMuon

    weight = torch.nn.Parameter(torch.eye(4) * 2.0)
    opt = TensorParallelMuon([weight], lr=0.5, momentum_beta=0.0, use_nesterov=False, weight_decay=0.0,
                             num_ns_steps=5, scale_mode="shape_scaling", mode="duplicated")
    weight.grad = torch.eye(4)
    opt.step()
    # a gradient that is already orthogonal: Newton-Schulz keeps (approximately) its direction, so the
    # diagonal moves by ~lr and the off-diagonal stays 0 (quintic coefficients land within 0.7-1.2)
    diagonal = torch.diagonal(weight.detach())
    assert torch.all((diagonal > 2.0 - 0.5 * 1.2) & (diagonal < 2.0 - 0.5 * 0.7))
    assert torch.count_nonzero(weight.detach() - torch.diag(diagonal)) == 0


def _callee_without(*names):
    def callee(self, params):  # takes neither of the renamed keywords
        return None

    return callee


def test_a_renamed_keyword_with_no_known_name_is_one_line_of_drift():
    with pytest.raises(UpstreamDrift) as raised:
        compat._renamed_kwarg(frozenset({"use_nesterov"}), _callee_without(), old="use_nesterov", new="nesterov",
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
    assert compat._renamed_kwarg(passes, old_style, old="use_nesterov", new="nesterov", what="f") is False
    assert compat._renamed_kwarg(passes, new_style, old="use_nesterov", new="nesterov", what="f") is True
    assert compat._renamed_kwarg(frozenset(), new_style, old="use_nesterov", new="nesterov", what="f") is False


def test_drift_reaches_the_user_as_one_line_and_exit_2(tmp_path):
    """A stack fix that meets unknown code stops `nemo llm pretrain` with one line, no traceback."""
    script = (
        "import sys\n"
        "from bridge_ext import compat, cli\n"
        "from bridge_ext.stack import UpstreamDrift\n"
        "def drifted():\n"
        "    raise UpstreamDrift('emerging-optimizers 9.9: newton_schulz_tp takes neither mode= nor tp_mode=')\n"
        "compat.STACK_FIXES = (compat.StackFix(name='x', upstream='u', why='w', needed=drifted, apply=None),)\n"
        "sys.exit(cli.main(sys.argv[1:]))\n"
    )
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "-c", script, "llm", "pretrain", "--recipe", "qwen3_proxy_muon",
                             "--device", "cpu", f"checkpoint.save={out}", "train.train_iters=1"],
                            capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith("error: emerging-optimizers 9.9")
    assert "Traceback" not in result.stderr and not out.exists()


def test_package_of_names_the_installed_version():
    assert package_of("megatron.bridge.training.config") == f"megatron-bridge {metadata.version('megatron-bridge')}"
    assert package_of("emerging_optimizers.x") == f"emerging-optimizers {metadata.version('emerging-optimizers')}"


def _module_imports(path: Path) -> set[str]:
    """bridge_ext modules a file imports (at any depth: function-level imports count too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bridge_ext."):
            names.add(node.module.split(".")[1])
        elif isinstance(node, ast.ImportFrom) and node.module == "bridge_ext":
            names.update(alias.name for alias in node.names)
    return names


def test_no_import_cycles_between_our_modules():
    package = REPO / "bridge_ext"
    graph = {path.stem: _module_imports(path) - {path.stem} for path in package.glob("*.py") if path.stem != "__init__"}
    for init in package.glob("*/__init__.py"):  # a subpackage is one node: what any of its files imports
        graph[init.parent.name] = set().union(*map(_module_imports, init.parent.glob("*.py"))) - {init.parent.name}
    assert graph["stack"] <= {"errors"}  # the ground floor
    assert "cpu_mode" not in graph["compat"] and "compat" not in graph["te_guard"]

    def visit(node, trail):
        assert node not in trail, " -> ".join([*trail, node])
        for nxt in graph.get(node, ()):
            visit(nxt, (*trail, node))

    for module in graph:
        visit(module, ())
