"""The `nemo` command: fast listing, info, dry runs, YAML export, bad input, NeMo-Run passthrough."""

import json
import os
from pathlib import Path

import pytest
import yaml

from bridge_ext import commands
from bridge_ext.errors import UserError
from tests.nemo_cli import nemo_process
from tests.stack_shapes import config_differences


def run_main(capsys, *argv):
    code = commands.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_recipes_lists_every_recipe_with_preset_and_layout(capsys):
    code, out, _ = run_main(capsys, "llm", "recipes")
    assert code == 0
    lines = out.strip().splitlines()[1:]
    # 14 models x (muon, adamw) pre-training; x (sft, lora) x (muon, adamw) fine-tuning; 8 released checkpoints
    # (Kimi-K2-Instruct-0905, -Thinking, six Qwen3-2507) x (sft, lora) x (muon, adamw)
    assert len(lines) == 28 + 56 + 32
    kimi = next(line for line in lines if line.startswith("kimi_k2_muon "))
    assert " kimi_k2 " in kimi and "gb300x256: TP1 PP4 VP4 EP64 DP64 GBS4096" in kimi and "h100x512" in kimi
    # fine-tuning: Megatron Bridge's packed SFT batch of 8 (one pack per DP rank on Kimi K2's DP64)
    sft = next(line for line in lines if line.startswith("qwen3_8b_sft_muon "))
    assert sft.split()[1:4] == ["Qwen3-8B", "sft", "moonlight_sft"] and "h100x8: TP4 PP1 DP2 GBS8" in sft
    lora = next(line for line in lines if line.startswith("kimi_k2_lora_adamw "))
    assert " lora " in lora and "DP64 GBS64" in lora


def test_info_describes_a_finetune_recipe(capsys):
    code, out, _ = run_main(capsys, "llm", "info", "--recipe", "qwen3_8b_lora_muon", "--json")
    assert code == 0
    info = json.loads(out)
    assert (info["task"], info["base_recipe"], info["twin"]) == ("lora", "qwen3_8b_muon", "qwen3_8b_lora_adamw")
    # Megatron Bridge 0.3's _peft_common: LoRA dim 32, alpha 32 on the four linear layers, lr 1e-4, 50 warm-up
    assert (info["lora"]["dim"], info["lora"]["alpha"]) == (32, 32)
    assert info["lora"]["target_modules"] == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    assert (info["optimizer"]["lr"], info["scheduler"]["lr_warmup_iters"]) == (1e-4, 50)
    assert (info["global_batch_size"], info["micro_batch_size"], info["seq_length"]) == (8, 1, 2048)
    assert info["run"]["train_iters"] == 1000 and info["run"]["tokens_per_step"] == 8 * 2048
    code, _, err = run_main(capsys, "llm", "info", "--recipe", "qwen3_8b_lora_moun")
    assert code == 2 and err == ("error: unknown recipe 'qwen3_8b_lora_moun' (did you mean 'qwen3_8b_lora_muon'?); "
                                 "`nemo llm recipes` lists them\n")


def test_info_json_for_qwen3_8b(capsys):
    code, out, _ = run_main(capsys, "llm", "info", "--recipe", "qwen3_8b_muon", "--json")
    assert code == 0
    info = json.loads(out)
    assert info["name"] == "qwen3_8b_muon" and info["model_type"] == "qwen3"
    assert (info["num_layers"], info["hidden_size"]) == (36, 4096)
    assert abs(info["params_total"] / 8.2e9 - 1) < 0.01 and info["params_active"] == info["params_total"]
    assert info["optimizer"]["preset"] == "moonlight" and info["optimizer"]["ns_coefficients"] == "simple"
    assert info["optimizer"]["muon_extra_scale_factor"] == 0.2 and info["optimizer"]["weight_decay"] == 0.1
    assert {k for k in info["optimizer"] if k.startswith("muon_")} == {  # megatron-core 0.19's names, every stack
        "muon_momentum", "muon_split_qkv", "muon_nesterov", "muon_scale_mode", "muon_fp32_matmul_prec",
        "muon_coefficient_type", "muon_num_ns_steps", "muon_tp_mode", "muon_extra_scale_factor",
        "muon_scalar_optimizer"}
    assert info["layout"] == {"name": "h100x8", "tp": 4, "pp": 1, "vp": None, "ep": 1, "etp": 1, "cp": 1,
                              "dp": 2, "gpus": 8}
    assert (info["micro_batch_size"], info["global_batch_size"], info["seq_length"]) == (1, 256, 4096)
    assert info["precision"] == "bf16_mixed"


def test_info_for_kimi_k2_moe_counts(capsys):
    _, out, _ = run_main(capsys, "llm", "info", "--recipe", "kimi_k2_adamw", "--layout", "h100x512", "--json")
    info = json.loads(out)
    assert info["model_type"] == "kimi_k2" and info["optimizer"]["optimizer"] == "adam"
    assert 1.0e12 < info["params_total"] < 1.05e12 and 32e9 < info["params_active"] < 33e9
    assert info["layout"]["pp"] == 16 and info["layout"]["dp"] == 16


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("llm", "info", "--recipe", "kimi_k2_muom"), "unknown recipe 'kimi_k2_muom' (did you mean 'kimi_k2_muon'?)"),
        (("llm", "info", "--recipe", "kimi_k2_muon", "--layout", "gb200x4"), "layout 'gb200x4' is not defined"),
        (("llm", "info"), "the following arguments are required: --recipe"),
        (("llm", "pretrain", "--recipe", "nope", "--dryrun"), "unknown recipe 'nope'"),
        (("llm", "pretrain", "--recipe", "kimi_k2_muon", "--yaml", "/nonexistent/my.yaml"), "does not exist"),
    ],
)
def test_fast_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run_main(capsys, *argv)
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_unknown_command_without_nemo_run(capsys, monkeypatch):
    monkeypatch.setattr(commands, "nemo_run_commands", lambda: None)
    code, _, err = run_main(capsys, "llm", "pretrain", "--factory", "llama3_8b")
    assert code == 2 and "needs --recipe" in err and "NeMo-Run" in err


# A NeMo-Run command group registered the way NeMo 2.7 registers `llm` (entry-point group `nemo_run.cli`),
# with an entrypoint and a factory: what `nemo llm pretrain --factory ...` reaches in the NeMo container.
_NEMO_RUN_LLM = """
import json, os
import nemo_run as run


@run.cli.entrypoint(namespace="llm", skip_confirmation=True)
def pretrain(max_steps: int = 1, name: str = "default"):
    with open(os.environ["LLM_PRETRAIN_OUT"], "w") as handle:
        json.dump({"max_steps": max_steps, "name": name}, handle)


@run.cli.factory(target=pretrain)
def tiny() -> run.Partial:
    return run.Partial(pretrain, max_steps=7, name="from-factory")
"""


@pytest.fixture
def nemo_run_llm_group(tmp_path):
    """Environment in which NeMo-Run discovers an `llm` group (a package plus its dist-info on PYTHONPATH)."""
    site = tmp_path / "site"
    (site / "llm_group").mkdir(parents=True)
    (site / "llm_group" / "__init__.py").write_text(_NEMO_RUN_LLM)
    info = site / "llm_group-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: llm-group\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[nemo_run.cli]\nllm = llm_group\n")
    return {**os.environ, "PYTHONPATH": str(site), "LLM_PRETRAIN_OUT": str(tmp_path / "out.json")}


@pytest.mark.once  # NeMo-Run 0.8.0 on every stack
@pytest.mark.slow
def test_nemo_run_factory_command_reaches_nemo_run_unchanged(nemo_run_llm_group, tmp_path):
    """`nemo llm pretrain --factory NAME key=value` (no --recipe) runs NeMo-Run's own CLI: the factory's
    values, then the override, as NeMo-Run resolves them."""
    result = nemo_process(["llm", "pretrain", "--factory", "tiny", "name=override", "--yes"], env=nemo_run_llm_group,
                          timeout=300)
    assert result.code == 0, result.stderr[-2000:]
    assert json.loads((tmp_path / "out.json").read_text()) == {"max_steps": 7, "name": "override"}


@pytest.mark.once  # NeMo-Run 0.8.0 on every stack
@pytest.mark.slow
def test_nemo_run_commands_and_help_come_from_nemo_run(nemo_run_llm_group):
    from nemo_run.cli import experiment

    result = nemo_process(["experiment", "--help"], env={**nemo_run_llm_group, "COLUMNS": "200"}, timeout=300)
    assert result.code == 0, result.stderr[-2000:]
    commands = [command.name or command.callback.__name__ for command in experiment.create().registered_commands]
    assert commands and all(name in result.stdout for name in commands), (commands, result.stdout)
    # our own commands stay ours, even with NeMo-Run's `llm` group installed
    ours = nemo_process(["llm", "recipes"], env=nemo_run_llm_group)
    assert ours.code == 0 and ours.stdout.startswith("recipe ")


@pytest.mark.slow
def test_dryrun_of_kimi_k2_prints_summary_and_the_shipped_yaml(nemo):
    result = nemo(["llm", "pretrain", "--recipe", "kimi_k2_muon", "--dryrun"])
    assert result.code == 0, result.stderr
    summary, _, resolved = result.stdout.partition("---\n")
    assert "TP1 PP4 VP4 EP64 ETP1 CP1 DP64 on 256 GPUs" in summary
    assert "dist_muon" in summary and "nesterov=True" in summary  # (use_)nesterov: the installed release's name
    shipped = (Path(__file__).parent.parent / "yaml" / "kimi_k2_muon.yaml").read_text()
    assert config_differences(shipped, resolved) == []


@pytest.mark.slow
def test_dryrun_with_yaml_and_overrides(capsys, tmp_path):
    my = tmp_path / "my.yaml"
    my.write_text("optimizer:\n  lr: 1.0e-4\n  muon_num_ns_steps: 6\n")
    code, out, err = run_main(capsys, "llm", "pretrain", "--recipe", "qwen3_30b_a3b_muon", "--yaml", str(my),
                              "optimizer.lr=2e-4", "train.global_batch_size=256", "--dryrun")
    assert code == 0, err
    resolved = yaml.safe_load(out.partition("---\n")[2])
    assert resolved["optimizer"]["lr"] == 2e-4
    assert resolved["optimizer"]["muon_num_ns_steps"] == 6
    assert resolved["train"]["global_batch_size"] == 256
    assert "global 256, micro 8" in out


@pytest.mark.slow
def test_to_yaml_writes_a_file_that_loads_back_identically(capsys, tmp_path):
    from megatron.bridge.training.config import ConfigContainer

    from bridge_ext.overrides import config_to_yaml

    target = tmp_path / "kimi.yaml"
    code, _, err = run_main(capsys, "llm", "pretrain", "--recipe", "kimi_k2_muon", "--to-yaml", str(target),
                            "optimizer.lr=2e-4")
    assert code == 0, err
    text = target.read_text()
    assert config_to_yaml(ConfigContainer.from_yaml(str(target))) == text
    assert yaml.safe_load(text)["optimizer"]["lr"] == 2e-4
    # the same file through --yaml reproduces the config
    again = tmp_path / "again.yaml"
    code, _, _ = run_main(capsys, "llm", "pretrain", "--recipe", "kimi_k2_muon", "--yaml", str(target),
                          "--to-yaml", str(again))
    assert code == 0 and again.read_text() == text
    # refusing to overwrite without --overwrite, leaving the file alone
    code, _, err = run_main(capsys, "llm", "pretrain", "--recipe", "kimi_k2_muon", "--to-yaml", str(target))
    assert code == 2 and "--overwrite" in err and target.read_text() == text


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "yaml_text", "message"),
    [
        (("optimizer.lrr=1e-4",), None, "unknown key 'optimizer.lrr' (did you mean 'lr'?)"),
        (("train.global_batch_size=abc",), None, "train.global_batch_size expects an integer"),
        (("--bogus",), None, "unrecognized arguments: --bogus"),
        ((), "optimizer: {lr: [1,\n", "is malformed"),
        ((), "trian:\n  train_iters: 5\n", "unknown key 'trian' (did you mean 'train'?)"),
        (("model.num_layers=60",), None, "Number of decoder layers 61must match num_layers 60"),
    ],
)
def test_bad_pretrain_input_exits_2_and_writes_nothing(capsys, tmp_path, args, yaml_text, message):
    target = tmp_path / "out.yaml"
    argv = ["llm", "pretrain", "--recipe", "kimi_k2_muon", "--to-yaml", str(target), *args]
    if yaml_text is not None:
        (tmp_path / "in.yaml").write_text(yaml_text)
        argv += ["--yaml", str(tmp_path / "in.yaml")]
    code, out, err = run_main(capsys, *argv)
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not target.exists() and sorted(p.name for p in tmp_path.iterdir()) == (["in.yaml"] if yaml_text else [])


@pytest.mark.slow
def test_pretrain_hands_the_resolved_config_to_megatron_bridge(capsys, monkeypatch):
    """On GPUs `pretrain` calls MB's pretrain() with the resolved config (the call itself needs GPUs)."""
    import torch
    from megatron.bridge.training import pretrain as mb_pretrain

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mb_pretrain, "pretrain", lambda cfg, step, callbacks: calls.append((cfg, step, callbacks)))
    from bridge_ext.muon import install_ns_coefficients

    try:
        code, _, err = run_main(capsys, "llm", "pretrain", "--recipe", "qwen3_8b_muon", "optimizer.lr=1e-4")
    finally:
        install_ns_coefficients("quintic")  # process-wide; leave megatron-core's default for other tests
    assert code == 0, err
    (cfg, step, callbacks), = calls
    assert cfg.optimizer.lr == 1e-4 and cfg.optimizer.optimizer == "dist_muon"
    assert cfg.optimizer.muon_extra_scale_factor == 0.2  # the recipe's moonlight preset
    assert [type(c).__name__ for c in callbacks] == ["MuonTelemetry", "GracefulStop"]
    assert cfg.train.exit_signal_handler and cfg.train.exit_signal_handler_for_dataloader  # SIGTERM saves
    assert cfg.model.tensor_model_parallel_size == 4 and step.__name__ == "forward_step"


@pytest.mark.slow
def test_full_recipe_refuses_cpu_mode(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = run_main(capsys, "llm", "pretrain", "--recipe", "qwen3_8b_muon")
    assert code == 2 and "8.2 B parameters and no GPU is visible" in err


@pytest.mark.slow
def test_training_validates_for_the_launched_world_size(monkeypatch):
    """Under torchrun, WORLD_SIZE (not the layout's GPU count) decides data parallelism."""
    from bridge_ext.commands.common import resolve
    from recipes import get_recipe

    args = commands.build_parser().parse_args(["llm", "pretrain", "--recipe", "qwen3_8b_muon"])
    monkeypatch.setenv("WORLD_SIZE", "16")
    resolved = resolve(args, get=get_recipe)
    assert resolved.layout.gpus == 8 and resolved.checked.data_parallel_size == 4
    monkeypatch.setenv("WORLD_SIZE", "6")  # TP4 cannot split 6 ranks
    with pytest.raises(UserError, match="6 GPUs are not divisible by model.tensor_model_parallel_size 4 x "
                                        "pipeline_model_parallel_size 1 x context_parallel_size 1 = 4"):
        resolve(args, get=get_recipe)


@pytest.mark.slow
def test_preset_and_layout_are_selectable_with_the_override_grammar(capsys):
    code, out, err = run_main(capsys, "llm", "pretrain", "--recipe", "kimi_k2_muon", "preset=adamw",
                              "layout=h100x512", "optimizer.lr=1e-4", "--dryrun")
    assert code == 0, err
    assert "(layout h100x512, optimizer preset adamw)" in out and "on 512 GPUs" in out
    resolved = yaml.safe_load(out.partition("---\n")[2])
    assert resolved["optimizer"]["optimizer"] == "adam" and resolved["optimizer"]["lr"] == 1e-4
    assert resolved["ddp"]["use_distributed_optimizer"] is True
    code, _, err = run_main(capsys, "llm", "pretrain", "--recipe", "kimi_k2_muon", "preset=adamx", "--dryrun")
    assert code == 2 and "unknown optimizer preset 'adamx' (did you mean 'adamw'?)" in err


def test_info_with_another_preset(capsys):
    _, out, _ = run_main(capsys, "llm", "info", "--recipe", "qwen3_8b_muon", "--preset", "adamw", "--json")
    assert json.loads(out)["optimizer"]["optimizer"] == "adam"


@pytest.mark.slow
def test_cpu_pretrain_on_text_writes_checkpoint_and_loss_curve(nemo, tmp_path):
    """`nemo llm pretrain` of a proxy with no GPU: real text, checkpoint, TensorBoard log and loss curve."""
    run = tmp_path / "run"
    result = nemo(
        ["llm", "pretrain", "--recipe", "qwen3_proxy_muon", "--device", "cpu", "train.train_iters=12",
         f"checkpoint.save={run}/ckpt", f"checkpoint.load={run}/ckpt", f"logger.tensorboard_dir={run}/tb"],
        cwd=tmp_path)
    assert result.code == 0, result.stderr[-2000:]
    assert "CPU mode" in result.stderr and "data: " in result.stderr and "stdlib" in result.stderr
    assert (run / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "12"
    losses = [json.loads(line) for line in (run / "ckpt" / "losses.jsonl").read_text().splitlines()]
    values = [r["loss"] for r in losses if "loss" in r]
    assert len(values) == 12 and values[-1] < values[0] - 0.5  # real text: ln(4096) = 8.3 at the start
    assert (run / "ckpt" / "loss.png").stat().st_size > 10_000 and any((run / "tb").iterdir())
    assert f"loss curve:      {run}/ckpt/loss.png" in result.stdout


# ------------------------------------------------------------------------ what Megatron refuses at launch
def megatron_layer_split_reason(*, num_layers: int, pipeline_model_parallel_size: int) -> str:
    """megatron-core's own words for layers that do not split evenly over pipeline stages: the assertion of its
    ``transformer_block.get_num_layers_to_build`` on its own ``TransformerConfig`` (0.16: "num_layers should be
    divisible by pipeline_model_parallel_size"; 0.17 on: "num_layers=36 should be divisible by
    config.pipeline_model_parallel_size=8")."""
    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    config = TransformerConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=4,
                               pipeline_model_parallel_size=pipeline_model_parallel_size, pipeline_dtype=torch.float32)
    with pytest.raises(AssertionError) as refused:
        get_num_layers_to_build(config, vp_stage=None, pp_rank=0)
    return " ".join(str(refused.value).split())


@pytest.mark.slow
@pytest.mark.stack  # Megatron's validation (and its words) differ between releases
@pytest.mark.parametrize(("recipe", "args", "message"), [
    # kimi_k2_muon on gb300x256: 256 GPUs / (TP1 x PP4 x CP1) = DP 64, MBS 2
    ("kimi_k2_muon", ["train.global_batch_size=4097"], "train.global_batch_size: global batch size (4097) is not "
     "divisible by micro batch size (2) times data parallel size (64) (256 GPUs)"),
    ("kimi_k2_muon", ["train.global_batch_size=-8"], "train.global_batch_size must be a positive integer, got -8"),
    ("kimi_k2_muon", ["train.micro_batch_size=0"], "train.micro_batch_size must be a positive integer, got 0"),
    ("kimi_k2_muon", ["train.train_iters=0"], "train.train_iters must be a positive integer, got 0"),
    ("kimi_k2_muon", ["model.num_moe_experts=100"],
     "model.num_moe_experts 100 is not divisible by model.expert_model_parallel_size 64"),
    ("kimi_k2_muon", ["model.expert_model_parallel_size=48"], "model.expert_model_parallel_size 48 x "
     "expert_tensor_parallel_size 1 x pipeline_model_parallel_size 4 = 192 does not divide 256 GPUs"),
    ("kimi_k2_muon", ["model.seq_length=262144", "dataset.sequence_length=262144"],
     "model.seq_length 262144 exceeds the model's max_position_embeddings 131072"),
    ("kimi_k2_muon", ["model.pipeline_model_parallel_size=2"],  # the layout string has 16 stages, PP2 x VP4 = 8
     "virtual_pipeline_model_parallel_size conflicts with pipeline_model_parallel_layout"),
    ("qwen3_8b_muon", ["model.tensor_model_parallel_size=3"], "8 GPUs are not divisible by "
     "model.tensor_model_parallel_size 3 x pipeline_model_parallel_size 1 x context_parallel_size 1 = 3"),
    ("qwen3_14b_muon", ["model.tensor_model_parallel_size=16"],  # 40 heads
     "num_attention_heads (40) must be a multiple of tensor_model_parallel_size (16)"),
    ("qwen3_8b_muon", ["model.tensor_model_parallel_size=1", "model.sequence_parallel=false",
                       "model.pipeline_model_parallel_size=8"],  # 36 layers: our fields, then Megatron's reason
     lambda: "model.num_layers 36 over pipeline_model_parallel_size 8 x virtual_pipeline_model_parallel_size 1: "
             + megatron_layer_split_reason(num_layers=36, pipeline_model_parallel_size=8)),
])
def test_dryrun_refuses_what_megatron_would_refuse_at_launch(capsys, tmp_path, monkeypatch, recipe, args, message):
    monkeypatch.chdir(tmp_path)
    message = message() if callable(message) else message
    code, out, err = run_main(capsys, "llm", "pretrain", "--recipe", recipe, *args, "--dryrun")
    assert code == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_kimi_k2_trains_the_real_router_and_the_bench_layout_says_why(capsys):
    code, out, err = run_main(capsys, "llm", "pretrain", "--recipe", "kimi_k2_muon", "--dryrun")
    summary, _, resolved = out.partition("---\n")
    assert code == 0, err
    assert yaml.safe_load(resolved)["model"]["moe_router_force_load_balancing"] is False
    assert "\nbenchmark " not in summary
    code, out, err = run_main(capsys, "llm", "pretrain", "--recipe", "kimi_k2_muon", "layout=gb300x256-bench",
                              "--dryrun")
    summary, _, resolved = out.partition("---\n")
    assert code == 0, err
    assert yaml.safe_load(resolved)["model"]["moe_router_force_load_balancing"] is True
    line = next(line for line in summary.splitlines() if line.startswith("benchmark "))
    assert "moe_router_force_load_balancing=True" in line and "do not keep the weights" in line
    assert "only for benchmark" in line  # megatron-core's own words


@pytest.mark.slow
def test_a_real_run_shows_megatrons_warnings_once_and_the_dry_run_does_not(nemo, tmp_path):
    """qwen3_proxy_muon for 2 iterations: its 5 warm-up iterations x GBS 8 = 40 samples exceed the 2 x 8 = 16
    of the whole run, which Megatron Bridge warns about (and caps); a user needs to see that."""
    argv = ["llm", "pretrain", "--recipe", "qwen3_proxy_muon", "train.train_iters=2", "--data", "mock"]
    warning = "lr_warmup_steps (40) >= lr_decay_steps (16)"
    dry = nemo_process([*argv, "--dryrun"], cwd=tmp_path, timeout=600)
    assert dry.code == 0 and "Warning" not in dry.stderr, dry.stderr[-2000:]
    real = nemo_process(argv, cwd=tmp_path, timeout=600)
    assert real.code == 0, real.stderr[-2000:]
    assert real.stderr.count(warning) == 1, real.stderr[-4000:]
    # the same command in the test process (the `nemo` fixture, after another run there) computes the same
    # losses, bit for bit
    for name in ("in_process", "again"):
        (tmp_path / name).mkdir()
        assert nemo(argv, cwd=tmp_path / name).code == 0
    records = [map(json.loads, (cwd / "nemo_experiments" / "qwen3_proxy_muon" / "checkpoints" / "losses.jsonl")
                   .read_text().splitlines()) for cwd in (tmp_path, tmp_path / "in_process", tmp_path / "again")]
    losses = [[r["loss"] for r in run if "loss" in r] for run in records]
    assert len(losses[0]) == 2 and losses[0] == losses[1] == losses[2], losses
    # each of Megatron's messages once (without Apex, megatron-core raises "Apex is not installed. Falling back
    # to Torch Norm" from four modules)
    megatron = [line.split("Warning: ", 1)[1] for line in real.stderr.splitlines()
                if "Warning: " in line and "/megatron/" in line]
    assert warning in " ".join(megatron) and len(megatron) == len(set(megatron)), megatron


@pytest.mark.once
def test_overrides_may_come_before_between_and_after_options():
    """argparse alone stops collecting ``key=value`` at the first option: `layout=cpu --dryrun x=1` was refused."""
    args = commands.build_parser().parse_args(
        ["llm", "pretrain", "layout=cpu", "--recipe", "qwen3_proxy_muon", "--dryrun", "train.train_iters=3",
         "optimizer.lr=2e-4"])
    assert (args.recipe, args.dryrun) == ("qwen3_proxy_muon", True)
    assert args.overrides == ["layout=cpu", "train.train_iters=3", "optimizer.lr=2e-4"]
    with pytest.raises(UserError, match=r"^unrecognized arguments: --bogus \(see `nemo --help`\)$"):
        commands.build_parser().parse_args(["llm", "pretrain", "--recipe", "qwen3_proxy_muon", "x=1", "--bogus"])
