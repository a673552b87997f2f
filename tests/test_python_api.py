"""The Python API (``bridge_ext.api``): a recipe's function returns the config the command resolves, and the
README's script, read from README.md (so the documentation cannot drift from what is tested), trains a proxy with
Megatron Bridge's own ``pretrain()``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def readme_script() -> str:
    """The one ```python block of README.md's "Python API" section."""
    section = REPO.joinpath("README.md").read_text().split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```python\n(.*?)^```$", section, flags=re.S | re.M)
    assert len(blocks) == 1, blocks
    return blocks[0]


def test_a_recipe_function_returns_what_to_yaml_writes(nemo, tmp_path):
    """Same recipe, parts and overrides through the command (``--to-yaml``) and the API: the same YAML, with the
    values the override text asks for."""
    from bridge_ext import api
    from bridge_ext.overrides import config_to_yaml
    from recipes.finetune import ALL_RECIPES

    assert {f"{name}_config" for name in ALL_RECIPES} <= set(api.__all__)
    overrides = ["preset=adamw", "optimizer.lr=2.5e-4", "train.train_iters=7", "train.global_batch_size=16"]
    out = tmp_path / "cli.yaml"
    result = nemo(["llm", "pretrain", "--recipe", "qwen3_proxy_muon", "--layout", "cpu-tp2", *overrides,
                   "--to-yaml", out])
    assert result.code == 0, result.stderr
    written = out.read_text()
    by_name = api.recipe_config("qwen3_proxy_muon", layout="cpu-tp2", overrides=overrides)
    by_function = api.qwen3_proxy_muon_config(layout="cpu-tp2", preset="adamw", overrides=overrides[1:])
    assert config_to_yaml(by_name) == written
    assert config_to_yaml(by_function) == written
    values = yaml.safe_load(written)
    assert (values["optimizer"]["optimizer"], values["optimizer"]["lr"]) == ("adam", 2.5e-4)
    assert (values["train"]["train_iters"], values["train"]["global_batch_size"]) == (7, 16)
    assert values["model"]["tensor_model_parallel_size"] == 2
    assert api.recipe_of(by_function).preset.name == "adamw"


def test_bad_input_is_the_commands_one_line_error():
    from bridge_ext.api import recipe_config
    from bridge_ext.errors import UserError

    with pytest.raises(UserError, match=r"^unknown recipe 'qwen3_proxy_muonn'.*qwen3_proxy_muon"):
        recipe_config("qwen3_proxy_muonn")
    with pytest.raises(UserError, match=r"layout 'gpu' is not defined for qwen3_proxy_muon"):
        recipe_config("qwen3_proxy_muon", layout="gpu")


@pytest.mark.slow
def test_the_readme_script_trains_a_proxy_with_megatron_bridges_pretrain(tmp_path):
    """README's script, as a user runs it (``python train.py``, no GPU visible): 4 iterations of the Kimi K2 proxy
    through Megatron Bridge's ``pretrain()``; Megatron's own iteration lines show the loss falling, and the
    checkpoint of iteration 4 is where the recipe saves."""
    (tmp_path / "train.py").write_text(readme_script())
    run = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.stderr[-3000:]
    losses = {int(m[1]): float(m[2]) for m in
              re.finditer(r"iteration\s+(\d+)/\s+4 \|.*?\| lm loss: ([0-9.E+-]+) \|", run.stdout)}
    assert sorted(losses) == [1, 2, 3, 4], run.stdout[-3000:]
    assert losses[4] < losses[1], losses
    checkpoints = tmp_path / "nemo_experiments" / "kimi_k2_proxy_muon" / "checkpoints"
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert (checkpoints / "iter_0000004").is_dir()
