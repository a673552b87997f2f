"""``torchrun --nproc-per-node 2 $(which nemo) llm import|export --tp/--pp/--ep 2`` on CPU (gloo) against the
one-process conversion of the same model, bit for bit.

The reference is the one-process ``import_hf`` / ``export_hf`` in this process; the two-process conversions run
in one torchrun launch (``tests/convert_rank_driver.py``: each command through the ``nemo`` entry point; the
first one makes its process group from torchrun's environment exactly as ``torchrun ... nemo`` does). Compared:
every tensor of the torch_dist checkpoint after import (torch_dist stores global tensors, so a TP/PP/EP import
must write the same bytes as a one-process one), every tensor of the exported safetensors, ``config.json``.

Cases: the Kimi K2 proxy (MLA, sigmoid router with expert bias, shared expert, a dense first layer, 8 experts)
imported and exported with EP2 and with TP2; the Qwen3-MoE proxy with PP2 and EP2. What each catches: EP2
without global SequentialMLP expert numbers loads the second rank's experts from HF experts 0-3 and exports
them under those names; TP2 with gloo's scatter of strided views scrambles row-parallel weights
(``linear_proj``, ``linear_fc2``); PP2 must broadcast each stage's layers for export.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import convert_rank_driver
from ckpt_io import assert_bit_identical, load_safetensors, load_torch_dist
import hf_fixtures
from bridge_ext.convert import export_hf, import_hf
from bridge_ext.errors import UserError

PROXIES = ("kimi_k2_proxy", "qwen3_moe_proxy")
CASES = [("kimi_k2_proxy", "ep2"), ("kimi_k2_proxy", "tp2"), ("qwen3_moe_proxy", "pp2"), ("qwen3_moe_proxy", "ep2")]
FLAGS = {"tp2": "--tp 2", "pp2": "--pp 2", "ep2": "--ep 2"}
BAD = {  # command -> the one line each rank prints (exit code 2, nothing written)
    "pp2_on_3_layers": ("import --hf {kimi_k2_proxy} --out {root}/bad_pp --pp 2",
                        "error: --pp 2 does not divide the model's 3 layers; choose a divisor of 3"),
    "tp2_ep2_on_2": ("export --ckpt {root}/kimi_k2_proxy/mg1 --out {root}/bad_tpep --tp 2 --ep 2",
                     "error: --tp 2 --pp 1 --ep 2 needs a multiple of 4 processes (TP x PP = 2, TP x EP = 4), this "
                     "run has 2; launch it with `torchrun --nproc-per-node 4 $(which nemo) llm ...` or lower the sizes"),
}  # fmt: skip


def two_process_runs(root: Path) -> dict:
    """HF dirs of both proxies, their one-process import + export, and one torchrun launch of the rest."""
    from recipes.models import HF_CONFIGS

    paths: dict = {"root": root}
    for seed, name in enumerate(PROXIES, start=5):
        raw = json.loads((Path(HF_CONFIGS) / name / "config.json").read_text())
        hf = hf_fixtures.write_hf_dir(root / name / "hf", raw, dtype=raw["torch_dtype"], config_json=raw, seed=seed)
        paths[name] = hf
        import_hf(hf, root / name / "mg1", progress=False, console=None)
        export_hf(root / name / "mg1", root / name / "hf1", progress=False, console=None)
    commands = []
    for name, layout in CASES:
        base = root / name
        commands += [f"llm import --hf {base / 'hf'} --out {base / ('mg_' + layout)} {FLAGS[layout]}",
                     f"llm export --ckpt {base / ('mg_' + layout)} --out {base / ('hf_' + layout)} {FLAGS[layout]}"]
    commands += ["llm " + command.format(**paths) for command, _ in BAD.values()]
    records, result = convert_rank_driver.launch(commands, root)
    for rank, record in enumerate(records):
        print(f"rank {rank}: " + ", ".join(f"{r['argv'].split()[1]} {r['argv'].split()[-1]} {r['seconds']} s "
                                           f"(peak RSS {r['maxrss_mb']:.0f} MB)" for r in record))  # fmt: skip
    return dict(paths, records=records, stdout=result.stdout, stderr=result.stderr)


@pytest.mark.slow
@pytest.mark.heavy
def test_two_process_conversions_equal_one_process(tmp_path):
    """For each case: import with 2 processes -> the one-process checkpoint's tensors; export of it with 2
    processes -> the one-process export's tensors, which are the source's (test_convert checks the
    one-process round trip). One test, one launch: xdist would build a module fixture on each worker."""
    runs = two_process_runs(tmp_path)
    for records in runs["records"]:
        assert [r["rc"] for r in records[: 2 * len(CASES)]] == [0] * (2 * len(CASES)), records
    for name, layout in CASES:
        case = f"{name} {layout}"
        base = runs["root"] / name
        reference = load_torch_dist(base / "mg1" / "iter_0000000", tmp_path, tensors_only=True)
        assert any(".experts." in key for key in reference), case  # the expert weights are among those compared
        assert_bit_identical(load_torch_dist(base / f"mg_{layout}" / "iter_0000000", tmp_path, tensors_only=True), reference, case)
        exported, source = load_safetensors(base / f"hf_{layout}"), load_safetensors(base / "hf")
        assert_bit_identical(exported, load_safetensors(base / "hf1"), case)
        assert_bit_identical(exported, source, case)
        assert (base / f"hf_{layout}" / "config.json").read_bytes() == (base / "hf" / "config.json").read_bytes()
        index = json.loads((base / f"hf_{layout}" / "model.safetensors.index.json").read_text())
        assert sorted(index["weight_map"]) == sorted(source), case
        # Each rank read only its shard of the source, yet the summary (rank 0 only) counts every tensor once.
        summaries = [line for line in runs["stdout"].splitlines() if line.endswith(f"-> {base / ('mg_' + layout)}")]
        assert len(summaries) == 1 and summaries[0].startswith(f"import: {len(source)} tensors"), (case, summaries)
    # Layouts the launch or the model cannot take: one line on each rank, exit code 2, nothing written.
    for key, (command, line) in BAD.items():
        for records in runs["records"]:
            assert next(r for r in records if r["argv"] == "llm " + command.format(**runs))["rc"] == 2, key
        assert runs["stderr"].count(line + "\n") == 2, (key, runs["stderr"][-3000:])
    assert not any(p.name.startswith(("bad_", ".bad_")) for p in runs["root"].iterdir())


def test_a_parallel_layout_without_torchrun_names_the_launch(tmp_path, monkeypatch):
    """Refused before torch or Megatron load: the number of processes to launch, or that the model has no experts."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    moe, dense = hf_fixtures.qwen3_moe_dir(tmp_path / "moe"), hf_fixtures.qwen3_dir(tmp_path / "dense")
    with pytest.raises(UserError, match=r"^--tp 2 --pp 1 --ep 2 needs a multiple of 4 processes \(TP x PP = 2, TP x "
                                        r"EP = 4\), this run has 1; launch it with `torchrun --nproc-per-node 4 "):
        import_hf(moe, tmp_path / "out", tp=2, ep=2, progress=False, console=None)
    with pytest.raises(UserError, match=r"^--ep 2 needs a mixture-of-experts model; this one has no experts"):
        import_hf(dense, tmp_path / "out", ep=2, progress=False, console=None)
    assert not (tmp_path / "out").exists()
