"""bridge_ext.upstream_api: the copies of megatron-bridge v0.3.1's templates against upstream's own functions, field
by field, and the dry run's stand-ins decided by behaviour. No model is built: each test takes milliseconds once
Megatron Bridge is imported."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from typing import Any

import pytest

import bridge_ext  # noqa: F401  (before megatron.bridge: its import guard for machines without Transformer Engine)
from bridge_ext import upstream_api
from bridge_ext.upstream_patch import apply
from megatron.bridge.training.config import ConfigContainer, FinetuningDatasetConfig, TokenizerConfig
from megatron.bridge.training.mixed_precision import MixedPrecisionConfig, get_mixed_precision_config

pytestmark = pytest.mark.stack

apply("import")
# Upstream's templates, imported with the module (a second): the tests then take milliseconds.
COMMON = (importlib.import_module(upstream_api.RECIPES_COMMON)
          if importlib.util.find_spec(upstream_api.RECIPES_COMMON) else None)

# task -> (upstream's function in recipes/common.py, our copy)
TEMPLATES = {
    "pretrain": ("_pretrain_common", upstream_api._pretrain_common_inline),
    "sft": ("_sft_common", lambda: upstream_api._finetune_common_inline("sft")),
    "lora": ("_peft_common", lambda: upstream_api._finetune_common_inline("lora")),
}


def _fields(value: Any, prefix: str = "") -> dict[str, str]:
    """``{"train.train_iters": "300000", ...}``: every leaf of nested dataclasses, by repr."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {f"{prefix}<class>": type(value).__qualname__}
        for field in dataclasses.fields(value):
            out.update(_fields(getattr(value, field.name), f"{prefix}{field.name}."))
        return out
    return {prefix[:-1]: repr(value)}


def _as_of_v0_3_1(upstream: dict[str, str]) -> dict[str, str]:
    """Upstream's fields with what later releases moved or added put back as v0.3.1 had it, each decided by what the
    installed classes have: ``eval_interval`` / ``eval_iters`` moved from ``TrainingConfig`` to the new
    ``ValidationConfig`` (0.4.0; the copy leaves ``validation`` at its defaults), ``use_tokenizer_vocab_size=True``
    added to the pre-training template (0.6.0; the copy leaves the default)."""
    expected = dict(upstream)
    validation = {f.name: f for f in dataclasses.fields(ConfigContainer)}.get("validation")
    if validation is not None:
        defaults = validation.default_factory()
        for name in ("eval_interval", "eval_iters"):
            expected[f"train.{name}"] = expected[f"validation.{name}"]
            expected[f"validation.{name}"] = repr(getattr(defaults, name))
    if "use_tokenizer_vocab_size" in {f.name for f in dataclasses.fields(TokenizerConfig)}:
        default = TokenizerConfig(tokenizer_type="HuggingFaceTokenizer").use_tokenizer_vocab_size
        expected["tokenizer.use_tokenizer_vocab_size"] = repr(default)
    return expected


@pytest.mark.parametrize("task", sorted(TEMPLATES))
def test_the_copy_is_upstreams_template_field_by_field(task):
    """Where the installed Megatron Bridge has ``recipes/common.py`` (0.3.1 and later; CI: 26.04.01, 26.06.01,
    newest), our copy builds what upstream's own function builds, field by field, after the named moves of later
    releases (:func:`_as_of_v0_3_1`). The copy is what 0.3.0 runs; this is where it is proven."""
    name, copy = TEMPLATES[task]
    upstream = getattr(COMMON, name, None)
    if upstream is None:
        pytest.skip(f"no {upstream_api.RECIPES_COMMON}.{name} here (megatron-bridge 0.3.0): the copy is what runs")
    if task != "pretrain" and importlib.util.find_spec("megatron.bridge.recipes.utils.finetune_utils") is None:
        pytest.skip("recipes/utils/finetune_utils.py is gone (megatron-bridge 0.6): the copy's default_squad_config "
                    "is compared on 0.4-0.5")
    ours, theirs = _fields(copy()), _as_of_v0_3_1(_fields(upstream()))
    differ = {key: (ours.get(key), theirs.get(key)) for key in ours.keys() | theirs.keys()
              if ours.get(key) != theirs.get(key)}
    assert not differ, differ
    assert len(ours) > 100  # every field of every part compared, not only the top level


def test_the_templates_call_upstreams_function_where_installed():
    for task, build in (("pretrain", upstream_api.pretrain_template),
                        ("sft", lambda: upstream_api.finetune_template("sft")),
                        ("lora", lambda: upstream_api.finetune_template("lora"))):
        name, copy = TEMPLATES[task]
        expected = getattr(COMMON, name)() if hasattr(COMMON, name) else copy()
        assert _fields(build()) == _fields(expected), task


def test_mixed_precision_is_the_recipe_for_the_block_and_its_name_after():
    cfg = upstream_api.pretrain_template()
    name = cfg.mixed_precision
    assert name == "bf16_mixed"
    with upstream_api.mixed_precision_for_validate(cfg):
        assert isinstance(cfg.mixed_precision, MixedPrecisionConfig)
        assert cfg.mixed_precision == get_mixed_precision_config(name)
    assert cfg.mixed_precision == name


def test_sft_source_placeholder_only_where_the_dataset_configs_validate_asks_for_one():
    """The installed ``FinetuningDatasetConfig`` without a root, as ``bridge_ext.finetune`` builds it before the data is
    rendered: where its own ``validate()`` refuses that (megatron-bridge 0.6), the block names the placeholder and
    ``validate()`` passes; where it has none (0.3-0.5), nothing changes. Neither probe touches the config."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 0.6: the name is a deprecated subclass
        dataset = FinetuningDatasetConfig(dataset_root=None, seq_length=64)
    cfg = type("Cfg", (), {"dataset": dataset})()
    try:
        validate = dataset.validate
    except AttributeError:
        validate = None
    refuses = False
    if validate is not None:
        try:
            validate()
        except ValueError:
            refuses = True
    with upstream_api.sft_root_for_validate(cfg):
        assert dataset.dataset_root == (upstream_api.UNRENDERED_SFT_ROOT if refuses else None)
        if validate is not None:
            validate()
    assert dataset.dataset_root is None
    assert upstream_api._requires_sft_source(dataset) is refuses and dataset.dataset_root is None
