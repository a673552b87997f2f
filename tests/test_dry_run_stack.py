"""The dry run names the installed stack and the upstream fixes a run applies on it (issue 21), on every stack."""

from __future__ import annotations

import importlib.util

import pytest

from bridge_ext import commands


@pytest.mark.slow
@pytest.mark.stack
def test_the_dry_run_names_the_stack_and_the_fixes_it_applies(capsys):
    """Issue 21: `nemo llm pretrain --recipe kimi_k2_muon --dryrun` says which stack it resolved on and which
    upstream fixes a run applies there (versions read from the installed distributions' metadata)."""
    from importlib import metadata

    from bridge_ext.patches import REGISTRY

    assert commands.main(["llm", "pretrain", "--recipe", "kimi_k2_muon", "--dryrun"]) == 0
    out = capsys.readouterr().out.split("\n---\n")[0]
    stack = next(line for line in out.splitlines() if line.startswith("stack "))
    for distribution in ("megatron-bridge", "megatron-core", "emerging-optimizers", "torch", "transformers"):
        assert f"{distribution} {metadata.version(distribution)}" in stack
    fixes = next(line for line in out.splitlines() if line.startswith("fixes "))
    named = fixes.split("(", 1)[1].split(";")[0].split(", ")
    assert int(fixes.split()[1]) == len(named) and set(named) <= {p.name for p in REGISTRY}
    # Without Transformer Engine (every CPU machine), Megatron Bridge imports only through our import guard.
    assert ("te-import-guard" in named) == (importlib.util.find_spec("transformer_engine") is None)
