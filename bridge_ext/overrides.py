"""User overrides on top of a recipe: ``--yaml FILE`` then ``a.b=value`` arguments.

Both go through Megatron Bridge's own OmegaConf/Hydra path (``create_omegaconf_dict_config``,
``parse_hydra_overrides``, ``apply_overrides``). A YAML file may be a full dump (``--to-yaml`` output or
``yaml/<recipe>.yaml``, with ``_target_`` entries) or a partial one (``optimizer: {lr: 2e-4}``); only the
values that differ from the recipe (as ``--to-yaml`` would write it) are applied. Unknown keys and values of
the wrong type are refused. :func:`apply_user_overrides` returns the dotted keys it set: the values the user set
explicitly, which ``bridge_ext.build`` does not derive.

Commands that read a few config values without building the config (``nemo llm plan``, ``rehearse``) take their
``key=value`` items through :func:`parse_overrides` (the value as YAML reads it) and the layout's sizes through
:func:`layout_sizes` (:data:`LAYOUT_KEYS`): one grammar, one set of messages.
"""

from __future__ import annotations

import io
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from bridge_ext.errors import UserError, closest
from recipes.selection import key_value

if TYPE_CHECKING:
    from megatron.bridge.training.config import ConfigContainer

__all__ = ["LAYOUT_KEYS", "apply_user_overrides", "config_to_yaml", "layout_sizes", "load_yaml_file", "override_key",
           "parse_overrides", "parse_value", "positive_int", "set_dotted", "split_override", "value_of"]


# Keys MB's YAML dump uses to describe objects rather than dataclass fields.
_OBJECT_KEYS = ("_call_", "_partial_", "_args_")

# `key=value` overrides that change a layout (recipes.layouts.Layout: the parallel sizes, batch and sequence),
# and the Layout field each sets.
LAYOUT_KEYS = {
    "model.tensor_model_parallel_size": "tp", "model.pipeline_model_parallel_size": "pp",
    "model.virtual_pipeline_model_parallel_size": "vp", "model.expert_model_parallel_size": "ep",
    "model.expert_tensor_parallel_size": "etp", "model.context_parallel_size": "cp",
    "model.seq_length": "seq_length", "model.pipeline_model_parallel_layout": "pipeline_layout",
    "train.micro_batch_size": "micro_batch_size", "train.global_batch_size": "global_batch_size",
    "gpus": "gpus",
}


# ------------------------------------------------------------------------------------- the key=value grammar
def split_override(item: str, *, example: str = "optimizer.lr=2e-4") -> tuple[str, str]:
    """(key, value text) of a ``key=value`` override; a one-line error without ``=``."""
    pair = key_value(item)
    if pair is None:
        raise UserError(f"override '{item}' is not of the form key=value (e.g. {example})")
    return pair


def value_of(items: Sequence[str], key: str) -> str | None:
    """The value the last ``key=...`` among ``items`` gives (as on the command line, the later wins); None."""
    found = [pair[1] for pair in map(key_value, items) if pair and pair[0] == key]
    return found[-1] if found else None


def parse_value(text: str) -> Any:
    """An override's value as YAML reads it (``2`` an int, ``null`` None, ``[a, b]`` a list); text YAML cannot
    read stays text."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_overrides(items: Sequence[str], *, keys: Collection[str], command: str, example: str) -> dict[str, Any]:
    """``{key: value}`` of ``items`` for a command that reads only ``keys`` (``command``: its name in the
    messages); a later item for the same key wins, as on the training commands' command line."""
    values: dict[str, Any] = {}
    for item in items:
        key, text = split_override(item, example=example)
        if key not in keys:
            raise UserError(f"`{command}` cannot take '{key}'{closest(key, keys)}; it takes: {', '.join(keys)}")
        values[key] = parse_value(text)
    return values


def positive_int(key: str, value: Any) -> int:
    """``value``, which must be an int of at least 1 (a bool is not one)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UserError(f"{key} must be a positive integer, got {value!r}")
    return value


def layout_sizes(values: Mapping[str, Any]) -> dict[str, Any]:
    """The Layout fields that ``values`` (parsed overrides) set through :data:`LAYOUT_KEYS`: sizes positive
    integers, except ``vp`` (None: no virtual pipeline) and ``pipeline_layout`` (megatron-core's layout string)."""
    sizes = {}
    for key, value in values.items():
        name = LAYOUT_KEYS.get(key)
        if name is None:
            continue
        sizes[name] = value if name == "pipeline_layout" or (name == "vp" and value is None) else positive_int(
            key, value)
    return sizes


def set_dotted(cfg: Any, dotted: str, value: Any) -> None:
    """``cfg.a.b = value`` for ``dotted == "a.b"``; ``AttributeError`` when the field does not exist."""
    *parents, leaf = dotted.split(".")
    target = cfg
    for part in parents:
        target = getattr(target, part)
    if not hasattr(target, leaf):
        raise AttributeError(f"{type(target).__name__} has no field {leaf} ({dotted})")
    setattr(target, leaf, value)


def config_to_yaml(cfg: ConfigContainer) -> str:
    """The resolved config as Megatron Bridge's ``ConfigContainer.to_yaml`` writes it."""
    from megatron.bridge.utils.yaml_utils import safe_yaml_representers  # 0.3: defined here; 0.6: re-exported

    with safe_yaml_representers():
        return yaml.safe_dump(cfg.to_dict(), default_flow_style=False)


def load_yaml_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"YAML file {path} does not exist; pass a file written by --to-yaml or copied from yaml/")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"YAML file {path} is malformed{where}: {getattr(exc, 'problem', exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"YAML file {path} must hold a mapping of config sections, not {type(data).__name__}")
    return data


def _is_object_node(value: Any) -> bool:
    return isinstance(value, dict) and "_target_" in value and any(k in value for k in _OBJECT_KEYS)


def _yaml_diff(user: dict, base: dict, path: str, out: list[tuple[str, Any]]) -> None:
    """Collect (dotted path, value) for every leaf where ``user`` differs from ``base``."""
    for key, value in user.items():
        dotted = f"{path}.{key}" if path else str(key)
        if key == "_target_":
            if value != base.get("_target_"):
                raise UserError(f"{dotted} is {value}, the recipe has {base.get('_target_')}; "
                                "pick another recipe instead of changing a config class")
            continue
        if key not in base:
            raise UserError(f"unknown key '{dotted}'{closest(str(key), [k for k in base if k != '_target_'])}")
        current = base[key]
        if isinstance(value, dict) and isinstance(current, dict) and not _is_object_node(current):
            _yaml_diff(value, current, dotted, out)
        elif value != current:
            out.append((dotted, value))


def _lookup(tree: Any, dotted: str) -> tuple[bool, Any]:
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _check_override_keys(base: dict, overrides: list[str]) -> None:
    for item in overrides:
        split_override(item)
        key = override_key(item)
        found, _ = _lookup(base, key)
        if not found:
            parent, _, leaf = key.rpartition(".")
            ok, siblings = _lookup(base, parent) if parent else (True, base)
            hint = closest(leaf, siblings) if ok and isinstance(siblings, dict) else ""
            raise UserError(f"unknown key '{key}'{hint}")


def _type_name(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a mapping"}.get(type(value), type(value).__name__)


def _declared_float(cfg: Any, dotted: str) -> bool:
    """Whether the dataclass field at ``dotted`` is annotated ``float`` (megatron-core declares some float
    fields with an int default: ``TransformerConfig.qk_clip_threshold: float = 100``)."""
    *parents, leaf = dotted.split(".")
    for part in parents:
        cfg = getattr(cfg, part, None)
    field = getattr(cfg, "__dataclass_fields__", {}).get(leaf)
    return field is not None and "float" in str(field.type)


def _check_types(new: Any, old: Any, path: str, cfg: Any = None) -> Any:
    """``new`` with ints widened to floats where the recipe has a float (or the field is declared float);
    error on other type changes."""
    if isinstance(old, dict) and isinstance(new, dict):
        return {k: _check_types(v, old.get(k), f"{path}.{k}" if path else k, cfg) for k, v in new.items()}
    if old is None or new is None or type(old) is type(new):
        return new
    if isinstance(old, float) and isinstance(new, int) and not isinstance(new, bool):
        return float(new)
    if (isinstance(old, int) and not isinstance(old, bool) and isinstance(new, float)
            and _declared_float(cfg, path)):
        return new
    if isinstance(old, (list, tuple)) and isinstance(new, (list, tuple)):
        return new
    if isinstance(old, str) and old.startswith("torch.") and isinstance(new, str):
        return new
    raise UserError(f"{path} expects {_type_name(old)} (recipe value {old!r}), got {new!r}")


def _set_in_tree(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        tree = tree[part]
    tree[leaf] = value


def override_key(item: str) -> str:
    """The dotted key of a ``key=value`` override (Hydra's ``+``/``~`` prefixes dropped)."""
    pair = key_value(item)
    return (pair[0] if pair else item).lstrip("+~")


def apply_user_overrides(cfg: ConfigContainer, *, yaml_path: str | Path | None = None, overrides: list[str] = (),
                         derived: Mapping[str, Any] | None = None) -> set[str]:
    """Apply ``yaml_path`` then ``overrides`` to ``cfg`` in place (recipe < YAML < command line).

    ``derived``: the values ``bridge_ext.build`` will derive (dotted key -> value), for the config as
    ``--to-yaml`` writes it: a YAML value equal to one of them is not a setting. Returns the dotted keys set.
    """
    from megatron.bridge.training.utils.omegaconf_utils import (
        OverridesError,
        apply_overrides,
        create_omegaconf_dict_config,
        parse_hydra_overrides,
    )
    from megatron.bridge.utils.instantiate_utils import instantiate
    from omegaconf import OmegaConf

    from bridge_ext import patches

    patches.apply("config")  # the _target_s our own YAML holds are instantiable (yaml-signal-target)
    overrides = list(overrides)
    if yaml_path is None and not overrides:
        return set()
    derived = dict(derived or {})
    omega, excluded = create_omegaconf_dict_config(cfg)
    base = OmegaConf.to_container(omega)
    for dotted, value in derived.items():  # what the config will hold: the types an override must have
        _set_in_tree(base, dotted, value)
    object_values: list[tuple[str, Any]] = []
    explicit: set[str] = set()

    if yaml_path is not None:
        user = load_yaml_file(yaml_path)
        written = yaml.safe_load(io.StringIO(config_to_yaml(cfg)))
        for dotted, value in derived.items():
            _set_in_tree(written, dotted, value)
        diffs: list[tuple[str, Any]] = []
        _yaml_diff(user, written, "", diffs)
        plain = {}
        for dotted, value in diffs:
            if _is_object_node(value):
                try:
                    object_values.append((dotted, instantiate(value)))
                except Exception as exc:  # instantiate reports many error types
                    raise UserError(f"{dotted}: cannot build {value.get('_target_')}: {exc}") from None
            else:
                plain[dotted] = value
        OmegaConf.set_struct(omega, True)
        for dotted, value in plain.items():
            OmegaConf.update(omega, dotted, value, merge=False)
        explicit |= {dotted for dotted, _ in diffs}

    if overrides:
        _check_override_keys(base, overrides)
        try:
            omega = parse_hydra_overrides(omega, overrides)
        except OverridesError as exc:
            raise UserError(" ".join(str(exc).split()).split(" full_key:")[0]) from None
        explicit |= {override_key(item) for item in overrides}

    final = _check_types(OmegaConf.to_container(omega, resolve=True), base, "", cfg)
    final.pop("__version__", None)
    apply_overrides(cfg, final, excluded)
    for dotted, value in object_values:
        set_dotted(cfg, dotted, value)
    return explicit
