"""Composing and validating configs: Hydra defaults + groups + command-line overrides.

verl scripts write overrides as ``a.b=c`` and ``+a.b=c``; archer accepts both for every key its schema
knows, and rejects any key it does not know (with or without ``+``), naming the closest known key, so a
typo is never silently ignored. Keys the schema knows but archer does not act on (verl's, for scripts to port)
are listed in config/no_ops.py: the RL trainer's config check warns once when one asks for what archer does not
do, or refuses a value whose no-op would change the result. Free-form mappings (keys whose default is ``{}``) accept any sub-key.
A single value given for a list key is a one-element list, as verl takes it (``trainer.logger=console`` is
``[console]``): the list keys are those whose default is a list, and those whose default is null listed in
``NULL_DEFAULT_LIST_KEYS`` (marked "(list)" in their YAML comment).

A user's own full YAML in verl's layout (``user_config``, from ``--config-path/--config-name``) replaces the
defaults' values; it and the overrides pass through verl_compat.py for the verl keys archer lacks. An empty value
(``key=``, as an unset shell variable leaves it) of a boolean key is false, as verl reads it.
"""

from __future__ import annotations

import copy
import difflib
import functools
import logging
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from archer.atomic_files import write_text_atomically
from archer.config.verl_compat import is_verl_key, translate
from archer.errors import ArcherError

log = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parent

# List keys whose default is null (so the YAML cannot show that they take a list); each is marked "(list)"
# in its YAML comment. A key whose default is a list needs no entry here.
NULL_DEFAULT_LIST_KEYS: dict[str, frozenset[str]] = {
    "ppo_trainer": frozenset({"trainer.influence_trace.layers", "eval.k"}),
}


def _walk(node: Any, prefix: str, keys: set[str], open_maps: set[str], lists: set[str]) -> None:
    if isinstance(node, DictConfig):
        if prefix and len(node) == 0:
            open_maps.add(prefix)
        for k in node.keys():
            if not prefix and k == "defaults":  # Hydra's defaults list, not a config key
                continue
            path = f"{prefix}.{k}" if prefix else str(k)
            keys.add(path)
            child = node._get_node(k)
            if isinstance(child, ListConfig) and not child._is_interpolation():
                lists.add(path)
            _walk(child, path, keys, open_maps, lists)


def _schema(config_name: str) -> tuple[set[str], set[str], set[str]]:
    """A config's dotted keys, its free-form mappings and its list keys (list default or NULL_DEFAULT_LIST_KEYS)."""
    keys, open_maps, lists = _walked_schema(config_name)
    return set(keys), set(open_maps), set(lists)


@functools.cache
def _walked_schema(config_name: str) -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
    keys: set[str] = set()
    open_maps: set[str] = set()
    lists = set(NULL_DEFAULT_LIST_KEYS.get(config_name, ()))
    _walk(_defaults(config_name), "", keys, open_maps, lists)
    return frozenset(keys), frozenset(open_maps), frozenset(lists)


def known_keys(config_name: str) -> tuple[set[str], set[str]]:
    """All dotted keys of a config's defaults, and the free-form mappings among them."""
    keys, open_maps, _ = _schema(config_name)
    return keys, open_maps


def list_keys(config_name: str) -> set[str]:
    """Dotted keys whose value is a list: a list default, or an entry of NULL_DEFAULT_LIST_KEYS."""
    return _schema(config_name)[2]


def _defaults(config_name: str) -> DictConfig:
    """A config's YAML defaults (a copy of the file's one parse: the YAML is read once a process)."""
    return copy.deepcopy(_parsed_defaults(config_name))


@functools.cache
def _parsed_defaults(config_name: str) -> DictConfig:
    return OmegaConf.load(CONFIG_DIR / f"{config_name}.yaml")


LOOKUP_FOLDERS = frozenset({"benchmark"})  # YAML folders archer reads by name itself (archer eval), not Hydra groups


def config_groups() -> set[str]:
    """Hydra config groups (sub-folders of archer/config holding YAML options, but LOOKUP_FOLDERS)."""
    return {p.name for p in CONFIG_DIR.iterdir()
            if p.is_dir() and p.name not in LOOKUP_FOLDERS and any(p.glob("*.yaml"))}


def group_options(group: str) -> list[str]:
    """The options of a config group (its YAML files' names)."""
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def _closest(key: str, keys: Iterable[str]) -> str | None:
    """The known key nearest ``key``; a section that holds a ``path`` (``actor_rollout_ref.model``) is named by
    that key, which is what a value set on it means (``model=DIR``: ``actor_rollout_ref.model.path``)."""
    keys = sorted(keys)
    match = _nearest(key, keys)
    return f"{match}.path" if match is not None and f"{match}.path" in keys else match


def _nearest(key: str, keys: list[str]) -> str | None:
    match = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    if match:
        return match[0]
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
    if same_leaf:
        return same_leaf[0]
    leaves = {k.rsplit(".", 1)[-1]: k for k in keys}
    match = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.6)
    return leaves[match[0]] if match else None


def normalize_overrides(config_name: str, overrides: Sequence[str]) -> list[str]:
    """Check every override against the schema and rewrite it into a form Hydra applies.

    ``+key=v`` / ``++key=v`` on a known key become ``key=v``; keys inside free-form mappings become
    ``++key=v``; an unknown key raises ArcherError naming the closest known key.
    """
    keys, open_maps = known_keys(config_name)
    groups = config_groups()
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as e:
        raise ArcherError(f"cannot parse override: {e}", "write overrides as key=value, e.g. data.train_batch_size=64") from None
    out: list[str] = []
    for raw, ov in zip(overrides, parsed):
        key = ov.key_or_group
        if ov.is_delete():
            raise ArcherError(f"override {raw!r} deletes a key; archer's schema keys cannot be removed",
                              "set the key to null instead, e.g. key=null")
        value = raw.split("=", 1)[1] if "=" in raw else ""
        if value == "" and isinstance(OmegaConf.select(_defaults(config_name), key, default=None), bool):
            log.warning("override %r has an empty value (an unset shell variable?): read as false, as verl does", raw)
            value = "false"
        if key in groups and value != "null" and value not in group_options(key):
            options = group_options(key)
            near = difflib.get_close_matches(value, options, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ArcherError(f"unknown {key} preset {value!r}{hint}",
                              f"use {key}=NAME with one of: {', '.join(options)}")
        if key in keys or key in groups:
            out.append(f"{key}={value}")
        elif any(key.startswith(m + ".") for m in open_maps):
            out.append(f"++{key}={value}")
        else:
            near = _closest(key, keys)
            hint = f"did you mean {near!r}?" if near else "see archer/config/" + config_name + ".yaml for the keys"
            raise ArcherError(f"unknown config key {key!r} (in override {raw!r}): {hint}",
                              "fix the key's spelling; archer refuses keys it does not know so that no setting "
                              "is silently ignored")
    return out


def _unknown_keys(node: DictConfig, keys: set[str], open_maps: set[str], prefix: str = "") -> list[str]:
    """Dotted keys of a composed config that the schema does not know (outside free-form mappings)."""
    out: list[str] = []
    for k in node.keys():
        path = f"{prefix}.{k}" if prefix else str(k)
        if path not in keys:
            out.append(path)
        elif path not in open_maps and OmegaConf.is_dict(node._get_node(k)):
            out.extend(_unknown_keys(node._get_node(k), keys, open_maps, path))
    return out


def _missing_keys(node: DictConfig, prefix: str = "") -> list[str]:
    out: list[str] = []
    for k in node.keys():
        path = f"{prefix}.{k}" if prefix else str(k)
        if OmegaConf.is_missing(node, k):
            out.append(path)
        elif OmegaConf.is_dict(node._get_node(k)):
            out.extend(_missing_keys(node._get_node(k), path))
    return out


def _split_verl_overrides(config_name: str, overrides: Sequence[str]) -> tuple[list[str], list[tuple[str, Any]]]:
    """Overrides of archer's keys (as given) and of the verl keys archer lacks (key, parsed value)."""
    keys, open_maps = known_keys(config_name)
    archer_overrides: list[str] = []
    verl: list[tuple[str, Any]] = []
    for raw in overrides:
        key = raw.split("=", 1)[0].lstrip("+")
        known = key in keys or key in config_groups() or any(key.startswith(m + ".") for m in open_maps)
        if known or not is_verl_key(key) or "=" not in raw:
            archer_overrides.append(raw)
            continue
        try:
            parsed = OverridesParser.create().parse_overrides([raw.lstrip("+")])[0]
        except HydraException as e:
            raise ArcherError(f"cannot parse override: {e}", "write overrides as key=value") from None
        verl.append((key, parsed.value()))
    return archer_overrides, verl


HYDRA_KEYS = ("hydra.run.dir", "hydra.job.chdir")


def hydra_settings(overrides: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The overrides without Hydra's own (``hydra.run.dir=D``, ``hydra.job.chdir=B``), and those as a mapping."""
    rest: list[str] = []
    settings: dict[str, str] = {}
    for raw in overrides:
        key, _, value = raw.lstrip("+").partition("=")
        if not key.startswith("hydra."):
            rest.append(raw)
        elif key in HYDRA_KEYS:
            settings[key] = value
        else:
            raise ArcherError(f"Hydra setting {raw!r} is not supported by archer",
                              f"archer reads only {', '.join(HYDRA_KEYS)} of Hydra's own settings; drop it")
    return rest, settings


def _user_tree(user_config: Path | None) -> DictConfig:
    """A user's YAML (verl's layout), or an empty config."""
    if user_config is None:
        return OmegaConf.create({})
    if not user_config.is_file():
        raise ArcherError(f"config file {user_config} does not exist",
                          "pass --config-path=DIR --config-name=NAME.yaml naming an existing YAML file")
    try:
        user = OmegaConf.load(user_config)
    except (OSError, OmegaConfBaseException, ValueError, yaml.YAMLError) as e:
        raise ArcherError(f"config file {user_config} cannot be read: {e}", "fix the YAML") from None
    if not isinstance(user, DictConfig):
        raise ArcherError(f"config file {user_config} is not a mapping of config sections", "fix the YAML")
    for key in ("defaults", "hydra"):
        if key in user:
            raise ArcherError(f"config file {user_config} has a {key!r} section: archer reads one self-contained "
                              "config file without Hydra's defaults list or settings",
                              "save the composed config (verl: python3 -m verl.trainer.main_ppo --cfg job > F.yaml)"
                              f" and pass that file; drop the {key!r} section")
    return user


def _compose(config_name: str, normalized: list[str], base: DictConfig | None) -> DictConfig:
    """Hydra's composition of the defaults (or of the defaults with ``base``'s values over them) and overrides."""
    if base is None:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            return compose(config_name=config_name, overrides=normalized)
    with tempfile.TemporaryDirectory(prefix="archer-config-") as tmp:
        merged = OmegaConf.merge(_defaults(config_name), base)
        (Path(tmp) / f"{config_name}.yaml").write_text(OmegaConf.to_yaml(merged), encoding="utf-8")
        for group in config_groups():
            (Path(tmp) / group).symlink_to(CONFIG_DIR / group, target_is_directory=True)
        with initialize_config_dir(config_dir=tmp, version_base=None):
            return compose(config_name=config_name, overrides=normalized)


def load_config(config_name: str, overrides: Sequence[str] = (), user_config: Path | None = None) -> DictConfig:
    """Compose ``archer/config/<config_name>.yaml`` (with a user's verl-layout YAML over it) and overrides;
    resolved and validated (struct: unknown keys cannot be added)."""
    archer_overrides, verl_overrides = _split_verl_overrides(config_name, overrides)
    user = _user_tree(user_config)
    for key, value in verl_overrides:
        OmegaConf.update(user, key, value, force_add=True, merge=False)
    keys, open_maps = known_keys(config_name)
    source = str(user_config) if user_config is not None else "override"
    base = translate(user, keys, open_maps, lambda key: _closest(key, keys), source)
    normalized = normalize_overrides(config_name, archer_overrides)
    try:
        cfg = _compose(config_name, normalized, base if user_config is not None or len(base) else None)
    except (HydraException, OmegaConfBaseException) as e:
        raise ArcherError(f"invalid override: {e}", "check the value's type against the default in "
                          f"archer/config/{config_name}.yaml") from None
    stray = _unknown_keys(cfg, *known_keys(config_name))
    if stray:
        raise ArcherError(f"config group option(s) set unknown key(s): {', '.join(stray)}",
                          f"fix the option's YAML under archer/config/: every key must exist in {config_name}.yaml")
    missing = _missing_keys(cfg)
    if missing:
        first = missing[0]
        raise ArcherError(f"required config key(s) not set: {', '.join(missing)}",
                          f"pass them on the command line, e.g. {first}=VALUE")
    try:
        container = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        raise ArcherError(f"config does not resolve: {e}", "check the ${...} references in your overrides") from None
    resolved = OmegaConf.create(container)
    _scalars_to_lists(resolved, list_keys(config_name))
    _check_types(_defaults(config_name), resolved, config_name)
    OmegaConf.set_struct(resolved, True)
    return resolved


def _scalars_to_lists(cfg: DictConfig, keys: set[str]) -> None:
    """A single value set for a list key becomes a one-element list (null stays null)."""
    for key in sorted(keys):
        value = OmegaConf.select(cfg, key)
        if value is not None and not OmegaConf.is_config(value):
            OmegaConf.update(cfg, key, [value])


def _type_ok(default: Any, value: Any) -> bool:
    if value is None or default is None:
        return True
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, int | float) and not isinstance(value, bool)
    if isinstance(default, DictConfig):
        return isinstance(value, DictConfig)
    return not isinstance(value, DictConfig)


def _whole_float_for_int(default: Any, value: Any) -> bool:
    return (isinstance(default, int) and not isinstance(default, bool) and isinstance(value, float)
            and value.is_integer())


def _check_types(defaults: DictConfig, cfg: DictConfig, config_name: str, prefix: str = "") -> None:
    """A value must keep its default's type (an int stays an int, a mapping stays a mapping; a whole float given
    for an int, such as 1., becomes that int)."""
    for k in defaults.keys():
        path = f"{prefix}.{k}" if prefix else str(k)
        node = defaults._get_node(k)
        if node._is_interpolation() or OmegaConf.is_missing(defaults, k) or k not in cfg:
            continue
        default = defaults[k]
        value = cfg._get_node(k) if OmegaConf.is_config(cfg._get_node(k)) else cfg[k]
        if _whole_float_for_int(default, value):  # verl's YAMLs write some counts as 1. (ARPO's beam_size)
            value = cfg[k] = int(value)
        if not _type_ok(default, value):
            kind = "a mapping" if isinstance(default, DictConfig) else type(default).__name__
            shown = "a mapping" if isinstance(default, DictConfig) else repr(default)
            raise ArcherError(f"config key {path} must be {kind} (default {shown}), got {value!r}",
                              f"pass a value of that type, e.g. {path}=<{kind}>")
        if isinstance(default, DictConfig) and len(default):
            _check_types(default, cfg[k], config_name, path)


def save_config(cfg: DictConfig, path: Path) -> None:
    """Write the resolved config as YAML (atomically)."""
    write_text_atomically(path, OmegaConf.to_yaml(cfg))


def as_list(value: Any) -> list:
    """A config value that may be a single item, a list, or null, as a Python list."""
    if value is None:
        return []
    if isinstance(value, ListConfig | list | tuple):
        return list(value)
    return [value]
