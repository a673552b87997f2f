"""Every patch row that applies on a stack has a current proof there (issue 49).

``bridge_ext/patches/proofs.json`` records, per row and stack, the commit at which ``tests/prove_patches.py``
last showed the row needed (its proving test failed with the row switched off) and the row's fingerprint then:
its code (target, condition, snippets, the functions that decide and make it) and its proving test's source. A row
whose code or proving test changed since fails here, named with the command that proves it again on that stack;
CI never runs the whole prover. Which rows apply on which stack: tests/test_patches.py's expectations (checked
against the installed code on every stack).
"""

from __future__ import annotations

import pytest

import prove_patches
import test_patches
from bridge_ext import patches
from bridge_ext.upstream_patch import Patch, always


def applying_by_stack() -> dict[str, set[str]]:
    """STACK -> the rows that apply there on these machines (tests/test_patches.py's expectations)."""
    everywhere = {p.name for p in patches.REGISTRY if p.needed is always}
    everywhere |= test_patches.APPLIES_ON_THIS_MACHINE | test_patches.APPLIES_ON_EVERY_RELEASE_READ
    return {stack: everywhere | test_patches.APPLIES_BY_STACK[key]
            for stack, key in test_patches.locked_stacks().items()}


def out_of_date_proofs(proofs: dict, fingerprints: dict[str, str], applying: dict[str, set[str]]) -> list[str]:
    """One line per (row, stack) whose proof is missing or older than the row's code or proving test."""
    found = []
    for stack, rows in applying.items():
        for row in sorted(rows & set(fingerprints)):
            proof = proofs.get(row, {}).get(stack)
            again = f"on {stack}: python tests/prove_patches.py '{row}' --record"
            if proof is None:
                found.append(f"{row}: never shown needed on {stack}; {again}")
            elif proof["fingerprint"] != fingerprints[row]:
                found.append(f"{row}: its code or proving test changed since {proof['commit']}, where it was "
                             f"shown needed on {stack}; {again}")
    found += [f"{row}: a proof of a row that no longer exists" for row in sorted(set(proofs) - set(fingerprints))]
    return found


@pytest.mark.once  # the records and the fingerprints are the same on every stack
def test_every_applying_row_has_a_current_proof_on_every_stack():
    stale = out_of_date_proofs(prove_patches.read_proofs(), prove_patches.current_fingerprints(), applying_by_stack())
    assert not stale, "\n".join(stale) + "\n(or on each stack: python tests/prove_patches.py --stale --record)"


@pytest.mark.once
def test_a_fingerprint_follows_the_code_and_the_test_not_the_wording(tmp_path):
    """The fingerprint changes with the proving test's body and with the row's code, not with its wording;
    the check names a changed row, a missing proof and a proof of a removed row."""
    (tmp_path / "tests").mkdir()
    test_file = tmp_path / "tests" / "test_x.py"
    test_file.write_text("import pytest\n\n\n@pytest.mark.slow\ndef test_a():\n    assert 1 + 1 == 2\n")
    row = Patch(name="row", area="cpu", scope="cpu", module="m", attr="a", upstream="u", why="w",
                make=lambda old: "patched")

    def fingerprint(patch: Patch) -> str:
        return prove_patches.fingerprint(patch, "tests/test_x.py::test_a[case]", root=tmp_path)

    first = fingerprint(row)
    assert fingerprint(Patch(**{**row.__dict__, "why": "reworded", "upstream": "reworded too"})) == first
    assert fingerprint(Patch(**{**row.__dict__, "snippets": ("code it relies on",)})) != first
    assert fingerprint(Patch(**{**row.__dict__, "make": lambda old: "patched otherwise"})) != first
    test_file.write_text(test_file.read_text().replace("1 + 1 == 2", "2 + 2 == 4"))
    assert fingerprint(row) != first
    test_file.write_text(test_file.read_text().replace("@pytest.mark.slow", "@pytest.mark.heavy"))
    changed = fingerprint(row)
    (tmp_path / "tests" / "test_x.py").write_text("# a comment above\n" + test_file.read_text())
    assert fingerprint(row) == changed  # the rest of the file is not the test

    proofs = {"a": {"s1": {"commit": "c1", "fingerprint": "f-old"}, "s2": {"commit": "c1", "fingerprint": "fa"}},
              "gone": {"s1": {"commit": "c0", "fingerprint": "x"}}}
    assert out_of_date_proofs(proofs, {"a": "fa", "b": "fb"}, {"s1": {"a", "b"}, "s2": {"a"}}) == [
        "a: its code or proving test changed since c1, where it was shown needed on s1; "
        "on s1: python tests/prove_patches.py 'a' --record",
        "b: never shown needed on s1; on s1: python tests/prove_patches.py 'b' --record",
        "gone: a proof of a row that no longer exists"]
