"""Fine-tuning: recipes, ``nemo llm finetune`` input checks, the loss mask, and real SFT / LoRA runs on the proxies.

Expected values come from outside the code under test: Megatron Bridge's published template numbers typed in,
token ids of hand-written rendered strings from the HF tokenizer, transformers' forward pass on the export.
"""

from __future__ import annotations

import itertools
import json
import shutil
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest

from bridge_ext import commands
from bridge_ext.errors import UserError
from tests.nemo_cli import Result, call_nemo

ROOT = Path(__file__).resolve().parent.parent
PROXY_TOKENIZER = ROOT / "recipes" / "tokenizer"


def nemo_llm(argv: list[str]) -> int:
    return commands.main(["llm", *argv])


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------------------ recipes
@pytest.mark.once
def test_every_model_has_sft_and_lora_recipes_with_adamw_twins():
    from recipes.finetune import FINETUNE_RECIPES
    from recipes.models import MODELS, RELEASES

    assert len(FINETUNE_RECIPES) == 4 * (len(MODELS) + len(RELEASES))  # releases: tests/test_release_variants.py
    for model in MODELS:
        for mode in ("sft", "lora"):
            muon, adamw = FINETUNE_RECIPES[f"{model}_{mode}_muon"], FINETUNE_RECIPES[f"{model}_{mode}_adamw"]
            assert (muon.preset.kind, adamw.preset.kind) == ("muon", "adamw")
            assert muon.twin == adamw.name and adamw.twin == muon.name and muon.mode == adamw.mode == mode
            assert muon.base == f"{model}_muon" and muon.model is adamw.model
            for key in ("lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2"):
                assert muon.preset.optimizer[key] == adamw.preset.optimizer[key], key
            assert dict(muon.preset.scheduler) == dict(adamw.preset.scheduler)
    # Megatron Bridge 0.3's _sft_common / _peft_common: lr 5e-6 (SFT) / 1e-4 (LoRA) -> 0, 50 warm-up, beta2 0.98
    sft, lora = FINETUNE_RECIPES["qwen3_8b_sft_muon"].preset, FINETUNE_RECIPES["qwen3_8b_lora_muon"].preset
    assert (sft.optimizer["lr"], lora.optimizer["lr"], sft.optimizer["min_lr"]) == (5e-6, 1e-4, 0.0)
    assert (sft.scheduler["lr_warmup_iters"], sft.scheduler["lr_decay_style"], sft.optimizer["adam_beta2"]) == (
        50, "cosine", 0.98)
    # Muon as in pre-training (Moonlight): scale 0.2 * sqrt(max(A, B)), Nesterov 0.95, Q/K/V and gate/up apart
    assert (sft.optimizer["muon_extra_scale_factor"], sft.optimizer["muon_momentum"]) == (0.2, 0.95)
    assert sft.optimizer["muon_split_qkv"] and sft.split_gate_up
    # LoRA: the low-rank factors are orthogonalized whole
    assert not lora.optimizer["muon_split_qkv"] and not lora.split_gate_up
    kimi = FINETUNE_RECIPES["kimi_k2_sft_muon"].preset
    assert kimi.model["qk_clip"] and kimi.model["qk_clip_threshold"] == 100.0 and not kimi.schedule_fractions
    assert not FINETUNE_RECIPES["kimi_k2_sft_adamw"].preset.model  # QK-clip belongs to MuonClip
    assert FINETUNE_RECIPES["qwen3_8b_lora_muon"].lora["dim"] == 32
    layout = FINETUNE_RECIPES["kimi_k2_sft_muon"].layout()
    assert (layout.seq_length, layout.global_batch_size, layout.micro_batch_size) == (2048, 64, 1)  # a pack per DP rank


@pytest.mark.once
def test_unknown_finetune_recipe_names_the_closest(capsys):
    assert nemo_llm(["finetune", "--recipe", "qwen3_8b_sft_moun", "--data", "x.jsonl", "--dryrun"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: unknown fine-tuning recipe 'qwen3_8b_sft_moun' (did you mean 'qwen3_8b_sft_muon'?); "
        "`nemo llm finetune --list` lists them")


@pytest.mark.once
def test_nemo_run_keeps_its_factory_finetune(monkeypatch):
    monkeypatch.setattr(commands, "nemo_run_commands", lambda: frozenset({"llm", "experiment"}))  # NeMo's group
    assert commands._route(["llm", "finetune", "--factory", "llama3_8b"]) == "nemo_run"
    assert commands._route(["llm", "finetune", "--recipe", "qwen3_8b_sft_muon", "--data", "x.jsonl"]) == "ours"
    assert commands._route(["llm", "finetune", "--list"]) == "ours"


# --------------------------------------------------------------------------------------------- bad input
@pytest.mark.once
@pytest.mark.parametrize("rows, message", [
    (None, "does not exist"),
    ([], "is empty"),
    ([{"input": "a", "output": "b"}, '{"input": "a", "output": '], "line 2 is not valid JSON"),
    ([{"input": "a", "output": "b"}, {"input": "a", "out": "b"}], "line 2 has keys input, out; each record needs"),
    ([{"messages": [{"role": "user", "content": "q"}]}], "line 1: the last message must be the assistant's"),
    ([{"messages": [{"role": "robot", "content": "q"}, {"role": "assistant", "content": "a"}]}], "message 0 needs"),
])
def test_bad_data_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys, rows, message):
    monkeypatch.setenv("MUON_RECIPES_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data.jsonl"
    if rows is not None:
        write_jsonl(data, rows)
    assert nemo_llm(["finetune", "--recipe", "qwen3_proxy_sft_muon", "--data", str(data),
                     "checkpoint.pretrained_checkpoint=."]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == (["data.jsonl"] if rows is not None else [])


@pytest.mark.once
def test_checkpoint_arguments_are_checked_first(tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", [{"input": "q", "output": "a"}] * 2)
    base = ["finetune", "--recipe", "qwen3_proxy_sft_muon", "--data", str(data)]
    for extra, message in (([f"--hf={tmp_path}/nope"], f"error: --hf {tmp_path}/nope does not exist"),
                           (["--hf", str(tmp_path)], f"error: --hf {tmp_path} is not a Hugging Face model directory"),
                           (["--hf", str(tmp_path), f"checkpoint.pretrained_checkpoint={tmp_path}"],
                            "error: pass either --hf DIR or checkpoint.pretrained_checkpoint=DIR, not both")):
        assert nemo_llm([*base, *extra]) == 2
        assert capsys.readouterr().err.startswith(message)


@pytest.mark.once
def test_tokenizer_without_chat_template_is_refused_before_writing(tmp_path):
    from bridge_ext.finetune.data import prepare_sft_data

    tokenizer = tmp_path / "tok"
    shutil.copytree(PROXY_TOKENIZER, tokenizer, ignore=shutil.ignore_patterns("chat_template*"))
    data = write_jsonl(tmp_path / "d.jsonl", [{"input": "q", "output": "a"}] * 3)
    with pytest.raises(UserError, match="has no chat template"):
        prepare_sft_data(data, tokenizer, cache=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


@pytest.mark.once
def test_shipped_instruction_set_pairs_docstrings_with_signatures():
    import ast

    from bridge_ext.finetune.instructions import instruction_records

    records = instruction_records(50)
    assert len(records) == 50 and len({r["input"] for r in records}) == 50
    for record in records:
        tree = ast.parse(record["output"] + " pass")  # a valid function header
        assert isinstance(tree.body[0], ast.FunctionDef) and not tree.body[0].name.startswith("_")
        assert record["input"].startswith("Write the signature of the Python function documented as: ")


@pytest.mark.once
def test_training_order_follows_dataset_seed(tmp_path, monkeypatch):
    """Megatron Bridge reads training.jsonl in file order: the recipe's dataset.seed orders the records we write."""
    from bridge_ext.build import resolve
    from bridge_ext.training import use_finetune_data
    from recipes.finetune import get_finetune_recipe

    data = write_jsonl(tmp_path / "d.jsonl", [{"input": f"q{i}", "output": f"a{i}"} for i in range(30)])

    def order(seed: int | None, cache: str) -> tuple[list[int], list[int]]:
        monkeypatch.setenv("MUON_RECIPES_CACHE", str(tmp_path / cache))
        resolved = resolve(get_finetune_recipe("qwen3_proxy_sft_muon"),
                           overrides=[] if seed is None else [f"dataset.seed={seed}"])
        recipe, cfg = resolved.recipe, resolved.cfg
        _, sft, _ = use_finetune_data(recipe, cfg, data)
        assert cfg.dataset.dataset_root == str(sft.root)
        rows = [[int(json.loads(line)["output"].strip()[1:]) for line in (sft.root / f"{name}.jsonl").open()]
                for name in ("training", "validation")]
        return rows[0], rows[1]

    train7, held7 = order(7, "c1")
    train8, held8 = order(8, "c1")
    again7, _ = order(7, "c2")  # rebuilt in another cache
    default, _ = order(None, "c1")
    assert sorted(train7) == sorted(train8) == [i for i in range(30) if i % 10 != 9]  # the same records
    assert held7 == held8 == [9, 19, 29]  # held out in file order: every seed is evaluated on the same batches
    assert train7 != train8 and train7 != sorted(train7)
    assert again7 == train7
    assert default not in (train7, sorted(train7))  # the recipe's own seed (5678) orders it too


# ------------------------------------------------------------------------------------------- data order
@pytest.mark.stack  # megatron-bridge 0.6's batch sampler reshuffles every epoch (patch sft-batches-in-dataset-order);
# 0.3-0.5's starts every epoch at the resume offset (patch sft-epochs-after-resume-from-the-start)
def test_finetuning_loaders_read_the_records_in_dataset_order():
    """Megatron Bridge's loader for fine-tuning (dataloader_type "batch", train and held-out alike) reads the records
    in the order bridge_ext.finetune wrote them, every epoch and from a resume point (docs/finetune.md, Data order):
    a resumed run reads what the uninterrupted run reads from that iteration on."""
    from bridge_ext import patches

    patches.apply("import")
    patches.apply("stack")
    from megatron.bridge.data.loaders import cyclic_iter  # how the training loop re-reads it, epoch after epoch
    from megatron.bridge.data.samplers import build_pretraining_data_loader

    class Records:  # record i is i; a padding index (-1) stays -1
        def __init__(self, n: int):
            self.n = n

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, index: int) -> int:
            return index

    def order(records: int, consumed: int, batches: int, *, drop_last: bool = True) -> list[int]:
        """The records of the next ``batches`` global batches (4 records each) of a run that consumed so many."""
        loader = build_pretraining_data_loader(Records(records), consumed, "batch", 2, 0, True,
                                               drop_last=drop_last, pin_memory=False, global_batch_size=4)
        return [int(i) for batch in itertools.islice(cyclic_iter(loader), batches) for i in batch]

    assert order(16, 0, 8) == [*range(16), *range(16)]
    # resumed mid-epoch (after 2 iterations): the rest of that epoch, then every later epoch from record 0
    assert order(16, 8, 6) == [*range(8, 16), *range(16)]
    # 10 records, the remainder dropped: every epoch is records 0-7 (2 iterations); after 3 iterations
    # (12 samples consumed) the run is half-way through its second epoch
    assert order(10, 0, 4) == [*range(8), *range(8)]
    assert order(10, 12, 3) == [*range(4, 8), *range(8)]
    # ... padded instead (drop_last=False): epochs of 3 iterations, the last one records 8-9 and padding (-1)
    assert order(10, 0, 3, drop_last=False) == [*range(10), -1, -1]
    assert order(10, 16, 5, drop_last=False) == [*range(4, 10), -1, -1, *range(10), -1, -1]
    # from every resume point, the next 3 epochs are the uninterrupted run's
    stream = order(10, 0, 12)
    for iterations in range(6):
        assert order(10, 4 * iterations, 6) == stream[4 * iterations:4 * iterations + 24], iterations


# ------------------------------------------------------------------------------------------- loss mask
@pytest.mark.stack  # the SFT dataset builder moved in megatron-bridge 0.6 (data/builders/gpt_sft.py)
def test_loss_mask_covers_only_the_last_answer(tmp_path):
    """Megatron Bridge's own SFT dataset over our rendered file: prompt tokens (earlier turns too) carry no loss.

    Built by the builder a fine-tuning run's dataset provider uses, over the rendered directory: 0.3-0.5
    ``data/builders/finetuning_dataset.py`` (through ``data/datasets/sft.py`` ``create_sft_dataset``), 0.6
    ``data/builders/gpt_sft.py`` (``build_gpt_sft_split``; ``create_sft_dataset`` is gone)."""
    from transformers import AutoTokenizer

    from bridge_ext.finetune.data import prepare_sft_data, sft_dataset_kwargs
    from bridge_ext import patches
    from bridge_ext.stack import first_defined

    patches.apply("import")
    from megatron.bridge.training.config import TokenizerConfig
    from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."},
            {"role": "assistant", "content": "2"}, {"role": "user", "content": "Another?"},
            {"role": "assistant", "content": "3"}]
    data = write_jsonl(tmp_path / "d.jsonl", [{"input": "Add two numbers.", "output": "def add(a, b):"},
                                              {"messages": chat}, {"input": "held", "output": "out"}])
    sft = prepare_sft_data(data, PROXY_TOKENIZER, cache=tmp_path / "cache")
    assert (sft.train, sft.validation) == (2, 1)
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer",
                                                tokenizer_model=str(PROXY_TOKENIZER)))
    builder = first_defined("FinetuningDatasetBuilder", "megatron.bridge.data.builders.finetuning_dataset",
                            "megatron.bridge.data.builders.gpt_sft")
    dataset, validation, test = builder(dataset_root=sft.root, tokenizer=tokenizer, seq_length=128, seed=1234,
                                        memmap_workers=1, dataset_kwargs=sft_dataset_kwargs(), do_validation=False,
                                        do_test=False).build()
    assert validation is None and test is None and len(dataset) == 2
    hf = AutoTokenizer.from_pretrained(str(PROXY_TOKENIZER))
    eos = hf.convert_tokens_to_ids("<|endoftext|>")
    expected = [  # the proxy template written out by hand: <|role|>\ncontent\n per turn
        ("<|user|>\nAdd two numbers.\n<|assistant|>\n", "def add(a, b):\n"),
        ("<|system|>\nBe brief.\n<|user|>\nName a prime.\n<|assistant|>\n2\n<|user|>\nAnother?\n<|assistant|>\n", "3\n"),
    ]
    for index, (prompt, answer) in enumerate(expected):
        p, a = hf.encode(prompt, add_special_tokens=False), hf.encode(answer, add_special_tokens=False)
        batch = dataset.collate_fn([dataset[index]])
        n = len(p) + len(a)  # tokens = all but the last id; labels = all but the first
        assert batch["tokens"][0, :n].tolist() == p + a
        assert batch["labels"][0, :n].tolist() == p[1:] + a + [eos]
        assert batch["loss_mask"][0].tolist() == [0] * (len(p) - 1) + [1] * (len(a) + 1) + [0] * (
            batch["loss_mask"].shape[1] - n)


# ------------------------------------------------------------------------------------- dry run (full model)
@pytest.mark.stack  # the SFT dataset config and packing changed shape in megatron-bridge 0.6
@pytest.mark.parametrize("recipe, shown", [
    ("qwen3_8b_sft_muon", ["finetune    sft: full fine-tuning", "packed into 2048-token sequences",
                           "dist_muon lr=5e-06 min_lr=0.0", "TP4 PP1", "global 8, micro 1, seq 2048"]),
    ("kimi_k2_lora_muon", ["finetune    lora: LoRA dim 32 alpha 32", "qk-clip     threshold 100.0",
                           "lr=0.0001", "EP64 ETP1 CP1 DP64 on 256 GPUs", "global 64, micro 1, seq 2048"]),
])
def test_dryrun_validates_the_full_config(tmp_path, capsys, recipe, shown):
    data = write_jsonl(tmp_path / "x.jsonl", [{"input": "q", "output": "a"}])
    # Megatron Bridge validates a PEFT config only with its base checkpoint named (not read by a dry run)
    base = [f"checkpoint.pretrained_checkpoint={tmp_path}"] if "lora" in recipe else []
    assert nemo_llm(["finetune", "--recipe", recipe, "--data", str(data), "--dryrun", *base]) == 0
    out = capsys.readouterr().out
    summary, resolved = out.split("---\n", 1)
    for text in shown:
        assert text in summary, (text, summary)
    from megatron.bridge.training.config import FinetuningDatasetConfig  # its home moved in megatron-bridge 0.6

    assert f"_target_: {FinetuningDatasetConfig.__module__}.FinetuningDatasetConfig" in resolved
    assert ("megatron.bridge.peft.lora.LoRA" in resolved) == ("lora" in recipe)


# ------------------------------------------------------------------------------------ training (CPU proxies)
def _run(nemo, argv: list[str], *, cwd: Path) -> Result:
    result = nemo(["llm", *argv], cwd=cwd)
    assert result.code == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def proxy_ckpt(tmp_path_factory):
    """A Qwen3 proxy pre-trained by its own recipe (10 iterations): what the proxies fine-tune."""
    work = tmp_path_factory.mktemp("pretrain")
    in_process = partial(call_nemo, capture=None)  # a module's fixture: the output stays in pytest's report
    _run(in_process, ["pretrain", "--recipe", "qwen3_proxy_muon", f"checkpoint.save={work}/q",
                      f"checkpoint.load={work}/q", "train.train_iters=10", "checkpoint.save_interval=10"], cwd=work)
    return work / "q"


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.stack  # fine-tuning's data order, checkpoint save and resume (megatron-bridge 0.6's batch sampler)
def test_sft_eval_loss_falls_and_resume_is_bit_exact(nemo, proxy_ckpt, tmp_path):
    from bridge_ext.training import read_eval
    from bridge_ext.training import read_losses

    run = tmp_path / "sft"
    argv = ["finetune", "--recipe", "qwen3_proxy_sft_muon", "--data", "stdlib-signatures",
            f"checkpoint.pretrained_checkpoint={proxy_ckpt}", f"checkpoint.save={run}", f"checkpoint.load={run}",
            "train.train_iters=20", "checkpoint.save_interval=10", "train.eval_interval=10"]
    result = _run(nemo, argv, cwd=tmp_path)
    assert "eval loss (held-out)" in result.stdout
    evals = read_eval(run / "eval.jsonl")  # iteration 10, 20, then the final pass (20 again: same 64 records)
    assert list(evals) == [10, 20] and evals[20] < evals[10] - 0.05, evals
    first = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert first[-1]["eval_loss"] == first[-2]["eval_loss"]  # each pass covers the same held-out records
    losses = read_losses(run / "losses.jsonl")
    # resume from iteration 10 of a copy: iterations 11-20 and the final eval loss are bit-identical
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed, ignore=shutil.ignore_patterns("iter_0000020", "*.jsonl", "latest_train_state.pt"))
    (resumed / "latest_checkpointed_iteration.txt").write_text("10")
    _run(nemo, [*argv[:-4], f"checkpoint.save={resumed}", f"checkpoint.load={resumed}", *argv[-3:]], cwd=tmp_path)
    again = read_losses(resumed / "losses.jsonl")
    assert list(again) == list(range(11, 21))
    assert again == {i: losses[i] for i in range(11, 21)}
    assert read_eval(resumed / "eval.jsonl")[20] == evals[20]
    # the fine-tuned checkpoint exports to HF: transformers loads it, its logits are the Megatron model's, and
    # fine-tuning moved the weights away from the pre-trained ones
    import torch
    from transformers import AutoModelForCausalLM

    from bridge_ext.convert import export_hf, find_iteration, verify_logits

    export_hf(run, tmp_path / "hf", progress=False, console=None)
    export_hf(proxy_ckpt, tmp_path / "hf_base", progress=False, console=None)
    tuned, base = (AutoModelForCausalLM.from_pretrained(str(tmp_path / name), torch_dtype=torch.float32)
                   for name in ("hf", "hf_base"))
    assert type(tuned).__name__ == "Qwen3ForCausalLM"
    moved = [name for name, weight in base.state_dict().items() if not torch.equal(weight, tuned.state_dict()[name])]
    assert "model.layers.0.mlp.down_proj.weight" in moved, moved
    assert verify_logits(tmp_path / "hf", find_iteration(run)[0]) <= 1e-5  # fp32, as tests/test_convert.py


def _tensorboard_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of every ``tag`` event Megatron Bridge wrote to the run's TensorBoard log, in order."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    out = []
    for events in sorted(run_dir.glob("tb/events.out.tfevents.*")):
        for event in EventFileLoader(str(events)).Load():
            for value in event.summary.value:
                if value.tag == tag:
                    out.append((event.step, value.simple_value if value.HasField("simple_value")
                                else value.tensor.float_val[0]))
    return out


@pytest.mark.slow
@pytest.mark.once  # orchestration; fine-tuning itself trains on each stack (the LoRA and architecture tests)
def test_compare_runs_finetune_recipes_on_the_held_out_split(proxy_ckpt, tmp_path, monkeypatch, capsys):
    """`nemo llm compare` of two fine-tuning recipes: its held-out table is what Megatron Bridge itself logged."""
    import contextlib
    import csv

    from bridge_ext import compare
    from bridge_ext.process_state import reset_megatron_globals

    def in_this_process(spec_path, run_dir, env, log):
        """compare's worker (`python -m bridge_ext.compare --worker SPEC`) here: Megatron is imported already."""
        with monkeypatch.context() as m, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            m.chdir(run_dir)
            reset_megatron_globals()
            try:
                code = compare.main(["--worker", str(spec_path)])
            finally:
                reset_megatron_globals()
        return SimpleNamespace(poll=lambda: code, returncode=code, terminate=lambda: None)

    monkeypatch.setattr(compare.worker, "_launch_worker", in_this_process)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "ab"
    assert nemo_llm(["compare", "qwen3_proxy_sft_muon", "qwen3_proxy_sft_adamw", "--data", "stdlib-signatures",
                     "--iters", "2", "--out", str(out), "--device", "cpu", "--threads", "2",
                     f"checkpoint.pretrained_checkpoint={proxy_ckpt}", "train.eval_interval=1",
                     "train.eval_iters=1", "scheduler.lr_warmup_iters=1"]) == 0
    printed = capsys.readouterr().out
    held_out = printed.split("held-out loss", 1)[1].splitlines()  # the console's held-out table
    rows = list(csv.reader((out / "eval.csv").open()))
    assert rows[0] == ["iteration", "qwen3_proxy_sft_muon", "qwen3_proxy_sft_adamw"]
    table = {label: {int(r[0]): float(r[1 + i]) for r in rows[1:]} for i, label in enumerate(rows[0][1:])}
    summary = json.loads((out / "summary.json").read_text())
    first_losses = []
    for label, column in table.items():
        run = out / "runs" / label
        logged = _tensorboard_scalars(run, "lm loss validation")  # Megatron Bridge's own validation log
        # passes at 1 and 2, then the final pass after iteration 2: the table keeps the last pass per iteration
        assert [step for step, _ in logged] == [1, 2, 2]
        assert list(column) == [1, 2]
        for step, value in (logged[0], logged[2]):
            assert column[step] == pytest.approx(value, abs=2e-6)
            assert summary["eval"][label][str(step)] == pytest.approx(value, rel=1e-6)
            assert f"{value:.4f}" in next(line for line in held_out if line.startswith(label + " "))
        first_losses.append(_tensorboard_scalars(run, "lm loss")[0])
    # the same weights and the same first batch (data and order): the first training loss is equal; the first
    # step's learning rate is 0 (warm-up from 0), so both models are still the checkpoint at the first eval
    assert first_losses[0][0] == 1 and first_losses[0] == first_losses[1]
    muon, adamw = table["qwen3_proxy_sft_muon"], table["qwen3_proxy_sft_adamw"]
    assert muon[1] == adamw[1] and muon[2] != adamw[2]
    assert "576 training records in the order of seed 1234, 64 held out" in summary["data"]  # 640 records, every 10th
    assert ("each eval pass reads 8 held-out records (train.eval_iters 1 x global batch 8), not the 64"
            in summary["data"])


@pytest.mark.slow
def test_wrong_architecture_checkpoint_is_one_line(proxy_ckpt, tmp_path, capsys):
    assert nemo_llm(["finetune", "--recipe", "kimi_k2_proxy_sft_muon", "--data", "stdlib-signatures",
                     f"checkpoint.pretrained_checkpoint={proxy_ckpt}", f"checkpoint.save={tmp_path}/k"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # (torch warns at import)
    assert len(err) == 1 and not (tmp_path / "k").exists()
    assert err[0].startswith(f"error: checkpoint {proxy_ckpt} holds another model than kimi_k2_proxy_sft_muon's")
    assert "multi_latent_attention False (recipe: True)" in err[0]


@pytest.mark.slow
@pytest.mark.stack  # LoRAMerge moved and takes the TP group in megatron-bridge 0.6
def test_lora_trains_only_adapters_and_merged_export_matches_megatron(proxy_ckpt, tmp_path, monkeypatch):
    """LoRA (Muon over the adapters): base weights bit-identical, adapters changed; the merged export loads in
    transformers and its logits equal the Megatron model's (base + adapters, unmerged) on the same tokens."""
    import torch
    from megatron.bridge.training.callbacks import Callback
    from transformers import AutoModelForCausalLM

    from bridge_ext.convert import export_hf
    from bridge_ext.process_state import reset_megatron_globals
    from bridge_ext.build import resolve
    from bridge_ext.training import run_finetune
    from recipes.finetune import get_finetune_recipe

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "lora"
    resolved = resolve(get_finetune_recipe("qwen3_proxy_lora_muon"), training=True, overrides=[
        f"checkpoint.pretrained_checkpoint={proxy_ckpt}", f"checkpoint.save={run}", f"checkpoint.load={run}",
        "train.train_iters=6", "train.eval_interval=1000"])
    recipe, cfg = resolved.recipe, resolved.cfg
    ids = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(7))

    class Probe(Callback):
        def on_train_start(self, context):
            (chunk,) = [m.module if hasattr(m, "module") else m for m in context.model]
            self.before = {n: p.detach().clone() for n, p in chunk.named_parameters()}

        def on_train_end(self, context):
            (chunk,) = [m.module if hasattr(m, "module") else m for m in context.model]
            self.after = {n: p.detach().clone() for n, p in chunk.named_parameters()}
            self.trainable = {n for n, p in chunk.named_parameters() if p.requires_grad}
            chunk.eval()
            with torch.no_grad():
                positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
                self.logits = chunk(input_ids=ids, position_ids=positions, attention_mask=None).float()
                outs = [m.linear_out.weight for n, m in chunk.named_modules() if n.endswith(".adapter")]
                saved = [w.clone() for w in outs]
                for w in outs:  # the base model alone: adapters' B = 0
                    w.zero_()
                self.base_logits = chunk(input_ids=ids, position_ids=positions, attention_mask=None).float()
                for w, value in zip(outs, saved):
                    w.copy_(value)
            chunk.train()

    probe = Probe()
    reset_megatron_globals()
    try:
        run_finetune(recipe, cfg, data="stdlib-signatures", callbacks=[probe], quiet=True)
    finally:
        reset_megatron_globals()
    adapters = {n for n in probe.before if ".adapter." in n}
    assert adapters and probe.trainable == adapters  # only the A and B matrices train
    assert all(torch.equal(probe.before[n], probe.after[n]) for n in probe.before if n not in adapters)
    changed = [n for n in adapters if not torch.equal(probe.before[n], probe.after[n])]
    assert len(changed) == len(adapters)  # B starts at zero, A moves once B does: both change in 6 steps
    out = tmp_path / "hf"
    export_hf(run / "merged", out, progress=False, console=None)
    hf = AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = hf(input_ids=ids).logits.float()
    assert (probe.logits[..., :4096] - hf_logits).abs().max().item() < 1e-4
    assert (probe.base_logits - probe.logits).abs().max().item() > 1e-3  # the adapters matter: the merge is real


@pytest.mark.slow
@pytest.mark.heavy
def test_kimi_proxy_muon_sft_with_qk_clip_logs_the_max_logit(nemo, tmp_path):
    """MuonClip fine-tuning of the Kimi K2 proxy (MLA, no QK-norm): QK-clip on, the max attention logit logged."""
    import math
    import re

    import yaml

    base, run = tmp_path / "kimi", tmp_path / "kimi_sft"
    _run(nemo, ["pretrain", "--recipe", "kimi_k2_proxy_muon", f"checkpoint.save={base}", f"checkpoint.load={base}",
                "train.train_iters=2", "checkpoint.save_interval=2"], cwd=tmp_path)
    result = _run(nemo, ["finetune", "--recipe", "kimi_k2_proxy_sft_muon", "--data", "stdlib-signatures",
                         f"checkpoint.pretrained_checkpoint={base}", f"checkpoint.save={run}", f"checkpoint.load={run}",
                         "train.train_iters=5", "logger.log_interval=5", "train.eval_interval=5", "train.eval_iters=1",
                         "checkpoint.save_interval=5"], cwd=tmp_path)
    line = next(x for x in result.stdout.splitlines() if x.startswith(" [muon] iteration 5:"))
    logit = float(re.search(r"max_attention_logit ([0-9.e+-]+)", line).group(1))
    assert math.isfinite(logit) and 0 < logit < 100.0  # measured, and under the threshold QK-clip enforces
    model = yaml.safe_load((run / "iter_0000005" / "run_config.yaml").read_text())["model"]
    assert (model["qk_clip"], model["qk_clip_threshold"], model["qk_clip_alpha"]) == (True, 100.0, 0.5)
    assert model["multi_latent_attention"] and model["log_max_attention_logit"]
    # LoRA on the same MoE base: SequentialMLP deep-copies its config when building the merged model (the
    # training hooks on it used to fail that copy); the merged export loads in transformers with the
    # Megatron model's logits
    import torch
    from transformers import DeepseekV3ForCausalLM

    from bridge_ext.convert import export_hf, find_iteration, verify_logits
    from bridge_ext.hf import load_hf_config

    lora = tmp_path / "kimi_lora"
    _run(nemo, ["finetune", "--recipe", "kimi_k2_proxy_lora_muon", "--data", "stdlib-signatures",
                f"checkpoint.pretrained_checkpoint={base}", f"checkpoint.save={lora}", f"checkpoint.load={lora}",
                "train.train_iters=2", "train.eval_iters=1"], cwd=tmp_path)
    export_hf(lora / "merged", tmp_path / "kimi_lora_hf", progress=False, console=None)
    out = tmp_path / "kimi_lora_hf"  # Kimi K2's config names remote code: loaded as DeepSeek-V3, as in test_convert
    merged = DeepseekV3ForCausalLM.from_pretrained(str(out), config=load_hf_config(out), torch_dtype=torch.float32)
    assert merged.config.n_routed_experts > 1
    assert verify_logits(tmp_path / "kimi_lora_hf", find_iteration(lora / "merged")[0]) <= 1e-5
