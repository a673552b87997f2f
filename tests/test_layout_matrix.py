"""The layout matrix (issue 29): every proxy family saved in every CPU layout it ships exports on one process as
the model-built export does, bit for bit, and as a ``--tp/--pp/--ep`` export does; a checkpoint saved in one
layout resumes in another with the losses of the run that never changed layout.

Families: Qwen3 dense, Qwen3-MoE, Kimi K2 (MLA) and Moonlight proxies with their Muon recipes (``dist_muon``:
the layer-wise distributed optimizer, which shards Muon's state over the data-parallel ranks of ``cpu-dp2``),
plus the Qwen3 AdamW recipe on ``cpu-dp2`` with megatron-core's distributed optimizer. Layouts: the ``cpu*``
ones each proxy ships (recipes/layouts.py): dense ``cpu``, ``cpu-dp2``, ``cpu-tp2``, ``cpu-pp2``; MoE those and
``cpu-ep2``, ``cpu-tp2-ep2``.

Two tests, one run of the references and cycles (a fixture that runs it once per session): the cycle test on every
stack (``stack``, ``matrix``), the pairs test also ``heavy`` (CI: 26.02 and newest). The whole measured 650-750
CPU-seconds, 532 s of 26.08's CI selection beside its other tests, before the pairs moved to ``heavy``. How it stays
cheap:

- One reference run per family on one process (in this process), the layouts' cycle's length + 3 iterations,
  saved at iteration 2: its losses are what every other run must reproduce (the layouts compute the same
  global batch; fp32, ``muon_fp32_matmul_prec=highest`` as in tests/test_parallel_cpu.py, the presets' own
  ``muon_tp_mode=duplicated``; a fixed schedule, so a run's length does not change its learning rate).
- A covering cycle of resumes, one iteration each: ``cpu -> cpu-tp2-ep2 -> cpu-tp2 -> cpu-pp2 -> cpu-ep2 ->
  cpu-dp2 -> cpu`` (dense: ``cpu -> cpu-tp2 -> cpu-pp2 -> cpu-dp2 -> cpu``; the last one two iterations). Each
  phase resumes the previous phase's checkpoint and saves its own: every layout is a source once and a target
  once, and each phase's checkpoint is the one that layout saves (exported below). A phase's first loss checks
  the weights it loaded, the next phase's (or its second) loss the optimizer state it loaded.
- Every other ordered pair of the family's shipped layouts: a two-iteration resume of the cycle's checkpoint
  of the source layout in the target layout (Qwen3-MoE, Kimi K2 and Moonlight 30 pairs each, Qwen3 12, the
  cycle's included), and AdamW's distributed optimizer DP2 -> 1 (refused in one line; its checkpoint exports).
- One launch (tests/fork_launch.py) per process count for all families (tests/layout_matrix_driver.py): 4 processes
  (``cpu-tp2-ep2``), then 2 (every 2-process layout, the pairs into them, then the ``--tp/--pp/--ep`` exports),
  then this process, then one more 4-process launch for the pairs into ``cpu-tp2-ep2`` (their sources are
  saved by the 2-process launch). A run's own cost is ~2.5 s (2 processes) of start-up around 1-2 iterations.
- From step 0 in every layout (issue 38): per family, a 1-iteration run from scratch in each shipped layout,
  saved, in the same launches: its loss equals the one-process reference's first, and the weights it saved --
  the step-0 weights: the recipes' warmup starts at a learning rate of 0 -- equal a one-process scratch run's,
  read by torch's own DCP reader (tests/ckpt_io.py). ~2.5 s each in the launches already there; the steps after
  are the cycle's and pairs' (a resume in another layout reproduces the run).
- Kimi K2's TP2 x EP2 checkpoint: the layout is in the files (2 stored chunks per query projection), and random
  regions the streaming reader reads across chunk borders equal torch's own DCP -> torch.save conversion.

Expected values come from the reference (the one-process run: a second computation of the same steps) and from
the model-built export (megatron-core's own loader and Megatron Bridge's export), never from the code that
converts or re-lays-out.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckpt_io import assert_bit_identical, load_safetensors
from layout_matrix_driver import launch
from session_once import once_per_session

FAMILIES = {"qwen3": "qwen3_proxy_muon", "qwen3_moe": "qwen3_moe_proxy_muon", "kimi_k2": "kimi_k2_proxy_muon",
            "moonlight": "moonlight_proxy_muon"}
ADAMW = "qwen3_proxy_adamw"  # megatron-core's distributed optimizer wherever DP > 1 (its preset's)
# Cycle order: after the one-process reference, the process counts only fall (4, then 2, then 1): one launch each
ORDER = ["cpu", "cpu-tp2-ep2", "cpu-tp2", "cpu-pp2", "cpu-ep2", "cpu-dp2"]
# exports on 2 processes through the built model; kimi_k2/moonlight proxies have 3 layers (no --pp 2)
EXPORT_LAYOUTS = (["--tp", "2"], ["--ep", "2"], ["--pp", "2"])
SAVED_AT = 2
# fp32 matmuls in Newton-Schulz as tests/test_parallel_cpu.py (the presets' own muon_tp_mode, duplicated), and a
# schedule that does not follow train_iters
EXACT = ["optimizer.muon_fp32_matmul_prec=highest",
         "scheduler.lr_decay_iters=16", "scheduler.lr_wsd_decay_iters=4", "logger.log_interval=1"]
LOSS_TOL = 2e-6  # tests/test_parallel_cpu.py's re-layout tolerance (measured there <= 4.8e-7)


@dataclass(frozen=True)
class Phase:
    """One ``nemo llm pretrain`` run: ``recipe`` at ``layout``, resuming ``load`` at ``step`` (None: from
    scratch), training to ``iters``, saving into ``save`` every ``save_interval``."""

    family: str
    recipe: str
    layout: str
    load: Path | None
    step: int
    iters: int
    save: Path
    source: str | None = None  # the layout ``load`` was saved in
    save_interval: int = 1
    extra: tuple[str, ...] = ()

    @property
    def processes(self) -> int:
        from recipes import get_recipe

        return get_recipe(self.recipe).layout(self.layout).gpus

    def argv(self) -> list[str]:
        resume = [f"checkpoint.load={self.load}", f"checkpoint.ckpt_step={self.step}"] if self.load else []
        return ["llm", "pretrain", "--recipe", self.recipe, f"layout={self.layout}", f"train.train_iters={self.iters}",
                f"checkpoint.save={self.save}", f"checkpoint.save_interval={self.save_interval}",
                f"logger.tensorboard_dir={self.save}/tb", *resume, *EXACT, *self.extra]


def shipped_cpu_layouts(recipe: str) -> list[str]:
    from recipes import get_recipe

    shipped = [name for name in get_recipe(recipe).layouts if name.startswith("cpu")]
    assert set(shipped) <= set(ORDER), f"{recipe} ships {sorted(set(shipped) - set(ORDER))}: add it to ORDER"
    return [name for name in ORDER if name in shipped]


def cycle(family: str, tmp: Path) -> tuple[Phase, list[Phase]]:
    """The family's reference run and its cycle of one-iteration resumes (the last one two)."""
    recipe = FAMILIES[family]
    layouts = shipped_cpu_layouts(recipe)[1:] + ["cpu"]
    reference = Phase(family, recipe, "cpu", None, 0, SAVED_AT + len(layouts) + 1, tmp / f"{family}-ref",
                      save_interval=SAVED_AT)
    phases, load, source = [], reference.save, "cpu"
    for number, layout in enumerate(layouts, start=1):
        step = SAVED_AT + number - 1
        iters = step + (2 if number == len(layouts) else 1)
        save = tmp / f"{family}-{number}-{layout}"
        phases.append(Phase(family, recipe, layout, load, step, iters, save, source))
        load, source = save, layout
    return reference, phases


def from_scratch(family: str, tmp: Path) -> list[Phase]:
    """One iteration from step 0 in each of the family's shipped layouts (``cpu`` included), saved."""
    recipe = FAMILIES[family]
    return [Phase(family, recipe, layout, None, 0, 1, tmp / f"{family}-scratch-{layout}")
            for layout in shipped_cpu_layouts(recipe)]


def check_from_scratch(scratch: list[Phase], references: dict[str, Phase]) -> None:
    """Every layout starts where one process starts: the first loss equal, and the weights at iteration 1 (the
    warmup's learning rate 0: the step-0 weights) equal, tensor by tensor."""
    import torch

    from ckpt_io import read_global_tensors

    ones = {p.recipe: p for p in scratch if p.layout == "cpu"}
    for p in scratch:
        got, want = _losses(p.save), _losses(references[p.recipe].save)
        assert list(got) == [1] and got[1] == want[1], (p.save.name, got, want)
        if p.layout == "cpu":
            continue
        mine = read_global_tensors(p.save / "iter_0000001")
        one = read_global_tensors(ones[p.recipe].save / "iter_0000001")
        weights = [k for k in one if not k.startswith("optimizer") and isinstance(one[k], torch.Tensor)
                   and one[k].dim() >= 1]
        assert len(weights) > 10, sorted(one)
        for key in weights:
            assert torch.equal(mine[key], one[key]), (p.save.name, key)


def saved_checkpoints(reference: Phase, phases: list[Phase]) -> dict[str, tuple[Path, int]]:
    """Layout -> (checkpoint root, iteration) of the checkpoint the cycle saved in that layout."""
    saved = {"cpu": (reference.save, SAVED_AT)}
    saved.update({p.layout: (p.save, p.iters) for p in phases[:-1]})
    return saved


def pairs(family: str, saved: dict[str, tuple[Path, int]], which: list[tuple[str, str]], tmp: Path) -> list[Phase]:
    """Two-iteration resumes of the cycle's checkpoint of each source into each target (saved once, at the end:
    nothing resumes them)."""
    recipe = FAMILIES[family]
    out = []
    for source, target in which:
        load, step = saved[source]
        out.append(Phase(family, recipe, target, load, step, step + 2, tmp / f"{family}-{source}-to-{target}", source,
                         save_interval=step + 2))
    return out


def pairs_off_the_cycle(family: str) -> list[tuple[str, str]]:
    """Every ordered pair of the family's shipped layouts that its cycle does not resume."""
    layouts = shipped_cpu_layouts(FAMILIES[family])
    in_cycle = set(zip(layouts, layouts[1:] + ["cpu"]))
    return [(s, t) for s in layouts for t in layouts if s != t and (s, t) not in in_cycle]


def _nemo_here(argv: list[str]) -> None:
    """``nemo ARGV`` in this process (one process, CPU mode)."""
    from bridge_ext import commands
    from bridge_ext.process_state import reset_megatron_globals

    reset_megatron_globals()
    try:
        assert commands.main(argv) == 0, argv
    finally:
        reset_megatron_globals()


class _Clock:
    """Wall and CPU seconds (this process and its children) of a block, into ``times[what]``: on a shared
    machine the CPU seconds say what an idle 2-core CI machine needs (about CPU / 2 for a launch that keeps
    both cores busy, CPU for this process)."""

    def __init__(self, times: dict, what: str):
        self.times, self.what = times, what

    @staticmethod
    def _cpu() -> float:
        import resource

        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

    def __enter__(self):
        self.wall, self.cpu = time.time(), self._cpu()
        return self

    def __exit__(self, *exc):
        self.times[self.what] = f"{time.time() - self.wall:.1f} s wall, {self._cpu() - self.cpu:.1f} s CPU"


def _run(phases: list[Phase], exports: list[list[str]], tmp: Path, times: dict) -> None:
    """``phases`` in order of falling process count (4, 2, then this process); ``exports`` (distributed, 2
    processes) after the 2-process phases."""
    for nproc in (4, 2):
        plan = [p.argv() for p in phases if p.processes == nproc] + (exports if nproc == 2 else [])
        if plan:
            with _Clock(times, f"{nproc}-process launch, {len(plan)} phases") as clock:
                seconds = launch(plan, tmp, nproc=nproc)
            times[clock.what] += f" (phases: {seconds})"
    here = [p for p in phases if p.processes == 1]
    if here:
        with _Clock(times, f"{len(here)} runs in this process"):
            for p in here:
                _nemo_here(p.argv())


def _export_here(saved: dict[str, dict[str, tuple[Path, int]]], tmp: Path, times: dict) -> dict[tuple[str, str], dict]:
    """Every saved checkpoint exported on one process, streaming and ``--no-stream``."""
    out = {}
    with _Clock(times, "exports in this process"):
        for family, by_layout in saved.items():
            for layout, (root, step) in by_layout.items():
                dirs = {}
                for way, extra in (("stream", []), ("model", ["--no-stream"])):
                    dirs[way] = tmp / f"hf-{family}-{layout}-{way}"
                    _nemo_here(["llm", "export", "--ckpt", str(root), "--iteration", str(step), "--out",
                                str(dirs[way]), *extra])
                out[(family, layout)] = dirs
    return out


def distributed_exports(saved: dict[str, dict[str, tuple[Path, int]]], tmp: Path) -> tuple[list[list[str]], dict]:
    """One 2-process export per saved checkpoint, the export layouts taken in turn (those the model can take)."""
    from recipes import get_recipe

    plan, where = [], {}
    for family, by_layout in saved.items():
        layers = _num_layers(get_recipe(FAMILIES[family]))
        moe = "cpu-ep2" in by_layout
        usable = [a for a in EXPORT_LAYOUTS if (a[0] != "--ep" or moe) and (a[0] != "--pp" or layers % 2 == 0)]
        for number, (layout, (root, step)) in enumerate(by_layout.items()):
            sizes = usable[number % len(usable)]
            out = tmp / f"hf-{family}-{layout}-{sizes[0][2:]}2"
            plan.append(["llm", "export", "--ckpt", str(root), "--iteration", str(step), "--out", str(out), *sizes])
            where[(family, layout)] = (out, " ".join(sizes))
    return plan, where


def _num_layers(recipe) -> int:
    import json

    from recipes.models import HF_CONFIGS

    return json.loads((HF_CONFIGS / recipe.model.name / "config.json").read_text())["num_hidden_layers"]


def _losses(run: Path) -> dict[int, float]:
    from bridge_ext.training import read_losses

    return read_losses(run / "losses.jsonl")


def check_losses(phases: list[Phase], references: dict[str, Phase]) -> None:
    """Each resumed run's losses are the reference's at the same iterations, within LOSS_TOL."""
    worst, failures = {}, []
    for p in phases:
        got, want = _losses(p.save), _losses(references[p.recipe].save)
        assert list(got) == list(range(p.step + 1, p.iters + 1)), (p.save.name, got)
        assert all(math.isfinite(v) for v in got.values()), (p.save.name, got)
        worst[p.save.name] = max(abs(got[i] - want[i]) for i in got)
        if worst[p.save.name] > LOSS_TOL:
            failures.append((p.save.name, {i: (got[i], want[i]) for i in got}))
    print("\nloss |resumed - reference|:", {k: f"{v:.1e}" for k, v in worst.items()})
    assert not failures, failures


def check_integrity_records(phases: list[Phase]) -> None:
    """Every rank of every layout recorded the files it wrote (issue 37): one record per rank that wrote data files
    (DCP names them ``__<rank>_<n>.distcp``), and the whole iteration matches them."""
    import json
    import re

    from bridge_ext.checkpoints.integrity import verify

    for p in phases:
        iter_dir = p.save / f"iter_{p.iters:07d}"
        writers = {int(m.group(1)) for f in iter_dir.iterdir() if (m := re.match(r"__(\d+)_\d+\.distcp$", f.name))}
        records = [json.loads(f.read_text()) for f in sorted((iter_dir / ".integrity").glob("rank_*.json"))]
        ranks = {r["rank"] for r in records}
        assert ranks == set(range(records[0]["world_size"])) and writers <= ranks, (p.save.name, writers, ranks)
        for record in records:
            assert {f for f in record["files"] if f.endswith(".distcp")} == {
                f.name for f in iter_dir.glob(f"__{record['rank']}_*.distcp")}, (p.save.name, record["rank"])
        result = verify(iter_dir, scope="all")
        assert result.recorded and result.bytes == sum(f.stat().st_size for f in iter_dir.rglob("*") if f.is_file()
                                                       and ".integrity" not in f.parts), p.save.name


def check_te_checkpoint_keys(references: dict[str, Phase]) -> None:
    """The local spec saves under the Transformer Engine spec's keys, so a checkpoint made on CPU loads into a
    container's GPU run (issue 41; megatron-core's get_gpt_layer_with_transformer_engine_spec fuses GQA's input
    norm into linear_qkv, MLA's latent norms into linear_q_up_proj / linear_kv_up_proj, a dense MLP's norm into
    linear_fc1, and keeps an MoE layer's pre_mlp_layernorm)."""
    import re

    from torch.distributed.checkpoint import FileSystemReader

    for recipe, phase in references.items():
        saved = sorted(phase.save.glob("iter_*"))[-1]
        keys = [k for k in FileSystemReader(str(saved)).read_metadata().state_dict_metadata
                if not k.startswith("optimizer")]
        layers = {m.group(1) or "" for k in keys if (m := re.match(r"decoder\.layers\.(\d+\.)?", k))}
        assert layers, (recipe, keys)
        for layer in layers:
            mine = {k[len(f"decoder.layers.{layer}"):] for k in keys if k.startswith(f"decoder.layers.{layer}")}
            moe = any(".experts." in k or k.startswith("mlp.router.") for k in mine)
            mla = any(k.startswith("self_attention.linear_kv_down_proj.") for k in mine)
            assert not any(k.startswith(("self_attention.kv_layernorm.", "mlp.linear_fc1.layer_norm_weight") if moe
                                        else ("self_attention.kv_layernorm.", "pre_mlp_layernorm.")) for k in mine), \
                (recipe, layer, sorted(mine))
            assert ("pre_mlp_layernorm.weight" in mine) == moe, (recipe, layer)
            if mla:
                assert "self_attention.linear_kv_up_proj.layer_norm_weight" in mine and "input_layernorm.weight" in mine
            else:
                assert "self_attention.linear_qkv.layer_norm_weight" in mine and "input_layernorm.weight" not in mine


def check_exports(here: dict, distributed: dict) -> None:
    """Streaming export = ``--no-stream`` export = the 2-process ``--tp/--pp/--ep`` export, bit for bit."""
    for (family, layout), dirs in here.items():
        case = f"{family} saved at {layout}"
        want = load_safetensors(dirs["model"])
        assert len(want) > 10, case
        assert_bit_identical(load_safetensors(dirs["stream"]), want, f"{case}: streaming export")
        for file in ("config.json", "model.safetensors.index.json"):
            assert (dirs["stream"] / file).read_bytes() == (dirs["model"] / file).read_bytes(), (case, file)
        if (family, layout) in distributed:
            out, sizes = distributed[(family, layout)]
            assert_bit_identical(load_safetensors(out), want, f"{case}: export {sizes} on 2 processes")


def check_stored_chunks(root: Path, step: int, *, tp: int) -> None:
    """The layout is really in the files (a TP-sharded query projection is stored as ``tp`` chunks per layer),
    and any region the streaming reader reads, across stored chunk borders, equals that part of the global tensor
    torch's own DCP -> torch.save converter makes of the same files (tests/ckpt_io.py)."""
    import re

    import torch
    from torch.distributed.checkpoint import FileSystemReader

    from bridge_ext.checkpoints.torch_dist import TorchDistChunks
    from ckpt_io import read_global_tensors

    iter_dir = root / f"iter_{step:07d}"
    chunks = TorchDistChunks(iter_dir)
    try:
        meta = FileSystemReader(str(iter_dir)).read_metadata().state_dict_metadata
        query = [k for k in meta if k.endswith(("linear_qkv.weight", "linear_q_proj.weight", "linear_q_up_proj.weight"))]
        assert query, sorted(meta)
        for key in query:
            layers = 1 if re.search(r"\.layers\.\d+\.", key) else chunks.global_shape(key)[0]
            assert len(meta[key].chunks) == layers * tp, (key, len(meta[key].chunks))
        whole = {k: v for k, v in read_global_tensors(iter_dir).items() if not k.startswith("optimizer")}
        generator, checked = torch.Generator().manual_seed(0), 0
        for key, tensor in whole.items():
            if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
                continue
            for _ in range(3):
                lo = [int(torch.randint(0, n, (), generator=generator)) for n in tensor.shape]
                size = tuple(int(torch.randint(1, n - o + 1, (), generator=generator)) for n, o in zip(tensor.shape, lo))
                region = chunks.read_region(key, tuple(lo), size)
                want = tensor[tuple(slice(o, o + s) for o, s in zip(lo, size))]
                assert region.dtype == want.dtype and torch.equal(region, want), (key, lo, size)
                checked += 1
        assert checked > 100
    finally:
        chunks.close()


def adamw_dp2_phases(tmp: Path) -> tuple[Phase, list[Phase], Phase]:
    """AdamW with megatron-core's distributed optimizer on DP2, trained 2 iterations from scratch (DP draws the
    one-process weights: the reference's losses); its checkpoint on one process, where CPU mode has no
    distributed optimizer, is refused in one line (bridge_ext.relayout: that state loads only into one)."""
    reference = Phase("qwen3", ADAMW, "cpu", None, 0, 4, tmp / "adamw-ref", save_interval=4)
    dp2 = Phase("qwen3", ADAMW, "cpu-dp2", None, 0, SAVED_AT, tmp / "adamw-dp2")
    refused = Phase("qwen3", ADAMW, "cpu", dp2.save, SAVED_AT, 4, tmp / "adamw-dp2-to-cpu", "cpu-dp2")
    return reference, [dp2], refused


def check_refusal(nemo, phase: Phase) -> None:
    """DP2's distributed-optimizer checkpoint on one process: one line naming the fields, exit 2, no training."""
    done = nemo(phase.argv())
    assert done.code == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert f"{phase.load} iteration {phase.step} holds the distributed optimizer's state" in errors[0], errors[0]
    assert "optimizer.use_distributed_optimizer=true" in errors[0] and "checkpoint.load_optim=false" in errors[0]
    assert not (phase.save / "losses.jsonl").exists()


@dataclass
class Matrix:
    """What the cycle selection ran: the runs to check, the exports to compare, the checkpoints pairs resume."""

    references: dict[str, Phase]
    resumes: list[Phase]
    scratch: list[Phase]
    exported_here: dict
    exported_on_two: dict
    refused: Phase
    saved: dict[str, dict[str, tuple[Path, int]]]
    times: dict


def run_matrix(tmp: Path, families: list[str]) -> Matrix:
    """The references and cycles of ``families``, the exports of each cycle checkpoint, and the AdamW DP2 runs."""
    times: dict = {}
    references, cycles, saved, scratch = {}, [], {}, []
    for family in families:
        scratch += from_scratch(family, tmp)
        reference, phases = cycle(family, tmp)
        references[reference.recipe] = reference
        cycles += phases
        saved[family] = saved_checkpoints(reference, phases)
    reference, adamw_phases, refused = adamw_dp2_phases(tmp)
    references[ADAMW] = reference
    with _Clock(times, f"{len(references)} references in this process"):
        for reference in references.values():
            _nemo_here(reference.argv())
    plan, distributed = distributed_exports(saved, tmp)
    _run(cycles + adamw_phases + scratch, plan, tmp, times)
    # the distributed optimizer's checkpoint (optimizer state in per-bucket shards) exports too
    exported = dict(saved, **{"qwen3-adamw": {"cpu-dp2": (adamw_phases[0].save, SAVED_AT)}})
    here = _export_here(exported, tmp, times)
    return Matrix(references, cycles + adamw_phases, scratch, here, distributed, refused, saved, times)


@pytest.fixture
def matrix(cpu_mode, tmp_path_factory) -> Matrix:
    """The cycle selection, run once per test session for this module's two tests (tests/session_once.py: under
    pytest-xdist the first worker to ask runs it, the other waits and reads it)."""
    return once_per_session(tmp_path_factory, "layout-matrix", lambda root: run_matrix(root, list(FAMILIES)))


@pytest.mark.slow
@pytest.mark.stack
@pytest.mark.matrix
def test_every_family_saved_in_every_layout_exports_and_resumes_along_a_covering_cycle(matrix, nemo):
    """Qwen3, Qwen3-MoE, Kimi K2 and Moonlight proxies: from step 0 in every layout, the cycle (every layout a
    source and a target once), every export; AdamW DP2 -> 1 refused in one line."""
    check_exports(matrix.exported_here, matrix.exported_on_two)
    # the 4-process layout's checkpoint: experts and MLA in TP2 x EP2 chunks
    saved = next(p for p in matrix.resumes if p.recipe == FAMILIES["kimi_k2"] and p.layout == "cpu-tp2-ep2")
    check_stored_chunks(saved.save, saved.iters, tp=2)
    check_integrity_records(matrix.resumes)
    check_from_scratch(matrix.scratch, matrix.references)
    check_te_checkpoint_keys(matrix.references)
    check_refusal(nemo, matrix.refused)  # the nemo fixture drops what the test printed before
    print("\n" + "\n".join(f"{what}: {seconds}" for what, seconds in matrix.times.items()))
    check_losses(matrix.resumes, matrix.references)


@pytest.mark.slow
@pytest.mark.stack
@pytest.mark.matrix
@pytest.mark.heavy
def test_every_other_ordered_pair_of_layouts_resumes_with_the_reference_losses(matrix, tmp_path):
    """Every ordered pair of shipped layouts the cycle does not resume (Qwen3-MoE, Kimi K2 and Moonlight 24 each,
    Qwen3 8): a two-iteration resume of the cycle's checkpoint of the source in the target. ``heavy`` (CI: 26.02
    and newest): the cycle above resumes into and out of every layout on every stack."""
    times: dict = {}
    extra = [p for family in FAMILIES
             for p in pairs(family, matrix.saved[family], pairs_off_the_cycle(family), tmp_path)]
    assert len(extra) == 3 * 24 + 8
    _run(extra, [], tmp_path, times)  # falling process counts: into cpu-tp2-ep2 (4), the 2-process ones, then here
    print("\n" + "\n".join(f"{what}: {seconds}" for what, seconds in times.items()))
    check_losses(extra, matrix.references)


@pytest.mark.parametrize(("saved", "now", "refused"), [
    # (saved: dist-opt, fully reshardable, TP, PP), (now: dist-opt, load_optim, TP, PP), the line's distinctive part
    ((True, False, 1, 1), (False, True, 1, 1), "this run has none (CPU mode turns it off on one process)"),
    ((True, True, 2, 1), (False, True, 1, 1), "this run has none (CPU mode turns it off on one process)"),
    ((True, False, 2, 1), (True, True, 1, 1), "which loads only at TP2 PP1; this run is TP1 PP1"),
    ((True, False, 1, 1), (True, True, 1, 2), "which loads only at TP1 PP1; this run is TP1 PP2"),
    ((True, True, 2, 1), (True, True, 1, 2), None),     # the fully reshardable format changes TP and PP
    ((True, False, 2, 1), (True, True, 2, 1), None),     # the same TP and PP: any DP
    ((True, False, 2, 1), (False, False, 1, 1), None),   # checkpoint.load_optim=false: weights only
    ((False, False, 2, 1), (False, True, 1, 1), None),   # no distributed optimizer saved
])
def test_distributed_optimizer_state_a_layout_cannot_load_is_one_line(tmp_path, saved, now, refused):
    """bridge_ext.relayout.prepare reads the resumed iteration's run_config.yaml; the cases from megatron-core's
    DistributedOptimizer.sharded_state_dict (dp_reshardable: 'resharding only in DP dimension') and the
    measured KeyError 'step' of a distributed optimizer's state in torch's Adam."""
    from types import SimpleNamespace

    import yaml

    from bridge_ext import relayout
    from bridge_ext.errors import UserError

    dist, reshardable, tp, pp = saved
    (tmp_path / "iter_0000002").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
    (tmp_path / "iter_0000002" / "run_config.yaml").write_text(yaml.safe_dump({
        "optimizer": {"use_distributed_optimizer": dist},
        "checkpoint": {"save_optim": True, "ckpt_format": "torch_dist", "dist_ckpt_optim_fully_reshardable": reshardable},
        "model": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "expert_model_parallel_size": 1},
    }))
    dist_now, load_optim, tp_now, pp_now = now
    cfg = SimpleNamespace(
        checkpoint=SimpleNamespace(load=str(tmp_path), ckpt_step=None, finetune=False, load_rng=True, load_optim=load_optim),
        optimizer=SimpleNamespace(use_distributed_optimizer=dist_now),
        model=SimpleNamespace(tensor_model_parallel_size=tp_now, pipeline_model_parallel_size=pp_now,
                              expert_model_parallel_size=1))
    if refused is None:
        assert relayout.prepare(cfg, world_size=tp_now * pp_now) is None
        return
    with pytest.raises(UserError) as raised:
        relayout.prepare(cfg, world_size=tp_now * pp_now)
    line = str(raised.value)
    assert "\n" not in line and line.startswith(f"{tmp_path} iteration 2 holds the distributed optimizer's state")
    assert refused in line and "checkpoint.load_optim=false" in line, line
