"""A family in one place (docs/architecture.md, "Where a change goes"): each module of ``recipes/families/`` holds
everything specific to its family, and the shared tables hold nothing of a family that its module does not.

For each family module: its model specs, layouts and presets are the ones in the assembled tables
(``recipes.models.MODELS`` / ``RELEASES``, ``recipes.layouts.LAYOUTS``, ``recipes.PRESETS`` and fine-tuning's), the
patch rows it names are rows of ``bridge_ext.patches.REGISTRY`` and its HF config fixes are functions of
``bridge_ext.hf.config``; every spec, layout, family entry and shipped config.json of the shared tables is reached
from exactly one family module.
"""

from __future__ import annotations

from collections import Counter

import pytest

import recipes
from bridge_ext.hf import config as hf_config
from bridge_ext.patches import REGISTRY
from recipes.families import FAMILIES, MODULES, MUON_PRESET_BY_FAMILY, PROXY_OVERRIDES_BY_MODEL, module_of
from recipes.finetune import ALL_RECIPES, FINETUNE_PRESETS
from recipes.layouts import LAYOUTS
from recipes.model_spec import HF_CONFIGS
from recipes.models import MODELS, RELEASES

pytestmark = pytest.mark.once

NAMES = [m.__name__.rsplit(".", 1)[1] for m in MODULES]


def specs_of(module):
    return (*module.MODELS, *module.PROXIES, *module.RELEASES)


@pytest.mark.parametrize("module", MODULES, ids=NAMES)
def test_what_a_family_module_names_exists(module):
    model_type = module.FAMILY.model_type
    assert FAMILIES[model_type] is module.FAMILY and module_of(model_type) is module
    for spec in specs_of(module):
        assert (RELEASES if spec.release_of else MODELS)[spec.name] is spec, spec.name
        assert spec.family == model_type, spec.name
        assert spec.hf_config["model_type"] == model_type, spec.name  # its shipped config.json
        assert (spec.proxy_of is not None) == (spec in module.PROXIES), spec.name
    # its layouts: one entry per model and proxy (a release runs on its base's), the ones recipes use
    assert list(module.LAYOUTS) == [spec.name for spec in (*module.MODELS, *module.PROXIES)]
    for name, layouts in module.LAYOUTS.items():
        assert LAYOUTS[name] is layouts and layouts, name
    # its presets: the Muon preset its `_muon` recipes use, and exactly the presets all its recipes use
    assert MUON_PRESET_BY_FAMILY[model_type] == (module.MUON_PRESET, module.MUON_PRESET_WHY)
    assert module.MUON_PRESET in recipes.PRESETS
    for name in module.PRESETS:
        assert name in recipes.PRESETS or name in FINETUNE_PRESETS, name
    used = {r.preset.name for r in ALL_RECIPES.values() if r.model.family == model_type}
    assert set(module.PRESETS) == used
    for (model, suffix), overrides in module.PROXY_OVERRIDES.items():
        assert model in [spec.name for spec in module.PROXIES] and suffix in ("muon", "adamw")
        assert PROXY_OVERRIDES_BY_MODEL[model, suffix] is overrides
        assert recipes.get_recipe(f"{model}_{suffix}").overrides.items() >= overrides.items()
    # outside recipes/: by name only
    rows = {patch.name for patch in REGISTRY}
    assert module.PATCHES and [name for name in module.PATCHES if name not in rows] == []
    assert len(set(module.PATCHES)) == len(module.PATCHES)
    assert module.HF_CONFIG_FIXES
    for name in module.HF_CONFIG_FIXES:
        assert callable(getattr(hf_config, name, None)), f"bridge_ext.hf.config has no function {name}"


def test_the_shared_tables_hold_nothing_a_family_module_does_not():
    """Each spec, layout entry, family and shipped config.json is one family module's, and each once."""
    specs = Counter(spec.name for m in MODULES for spec in specs_of(m))
    assert [name for name, n in specs.items() if n > 1] == []
    assert set(specs) == set(MODELS) | set(RELEASES)
    layouts = Counter(name for m in MODULES for name in m.LAYOUTS)
    assert [name for name, n in layouts.items() if n > 1] == [] and set(layouts) == set(LAYOUTS)
    assert sorted(FAMILIES) == sorted(m.FAMILY.model_type for m in MODULES)
    assert set(MUON_PRESET_BY_FAMILY) == set(FAMILIES)
    shipped = {path.parent.name for path in HF_CONFIGS.glob("*/config.json")}
    assert shipped == set(specs)
    # the recipes are composed from these alone: every pre-training recipe's model is a family module's model
    assert {r.model.name for r in recipes.RECIPES.values()} == {s.name for m in MODULES for s in (*m.MODELS,
                                                                                                   *m.PROXIES)}
