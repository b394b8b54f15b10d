"""verl's config keys that archer's schema lacks: each renamed, mapped to an archer value, or (config/no_ops.py,
the one table of keys archer accepts without acting on) dropped with a warning or refused.

A user's own YAML in verl's layout (``archer train --config-path=DIR --config-name=NAME.yaml``, e.g. ARPO's
published ``ppo_trainer.yaml``) and command-line overrides both pass through ``translate``: a key archer knows
stays; a key of ``VERL_KEYS`` (or under a prefix of it) is renamed or mapped; a key of no_ops' table is dropped
(with one warning when its value is one under which verl would compute something archer does not), or refused
(an error when its value would change the result); any other key is an error naming the nearest known key.
docs/porting.md shows both tables.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from archer.config.no_ops import SCHEMA_LESS_KEYS, by_pattern, check_value, no_op_for
from archer.errors import ArcherError


@dataclass(frozen=True)
class Renamed:
    to: str


@dataclass(frozen=True)
class ValueMapped:
    """A switch that selects an archer value: ``values[v]`` is set at ``to`` (None: leave ``to`` as it is)."""
    to: str
    values: dict


Rule = Renamed | ValueMapped

ROLL = "actor_rollout_ref.rollout"

# verl keys (dotted; "x.*" covers everything under x) that archer knows by another name or value.
VERL_KEYS: dict[str, Rule] = {
    "actor_rollout_ref.actor.checkpoint.contents": Renamed("actor_rollout_ref.actor.checkpoint.save_contents"),
    "critic.checkpoint.contents": Renamed("critic.checkpoint.save_contents"),
    f"{ROLL}.agent.tools.*": Renamed(f"{ROLL}.tools"),  # ARPO's deep-search config (ppo_trainer_dr.yaml)
    "ray_init.num_cpus": Renamed("ray_kwargs.ray_init.num_cpus"),  # verl's older layout
    # Archer2.0's ASPO loss switch
    "actor_rollout_ref.actor.use_archer_policy_loss": ValueMapped("actor_rollout_ref.actor.policy_loss.loss_mode",
                                                                  {True: "aspo", False: None}),
}

# Values of an archer key that only verl uses, and what they are in archer (None: keep archer's default).
VERL_VALUES: dict[str, dict[Any, Any]] = {
    # verl's multi-turn format applies only with multi_turn.enable=true (refused above); ARPO's configs carry it
    # while ARPO's own loop (archer's default "arpo") does the tool calls
    f"{ROLL}.multi_turn.format": {"chatml": None},
}


def rule_for(key: str) -> tuple[str, Rule] | None:
    """The rename or mapping of a dotted key (its own entry, or the nearest ``prefix.*`` above it), with the
    table key that matched."""
    return by_pattern(VERL_KEYS, key)


def is_verl_key(key: str) -> bool:
    """A key archer lacks that VERL_KEYS or no_ops' table covers (or a parent mapping of such keys, e.g.
    ``ray_init``)."""
    known = (*VERL_KEYS, *SCHEMA_LESS_KEYS)
    return rule_for(key) is not None or no_op_for(key) is not None or any(p.startswith(key + ".") for p in known)


def _leaves(value: Any, prefix: str) -> Iterable[tuple[str, Any]]:
    if isinstance(value, dict) and value:
        for k, child in value.items():
            yield from _leaves(child, f"{prefix}.{k}")
    else:
        yield prefix, value


def apply_rule(key: str, value: Any, out: DictConfig, source: str) -> None:
    """Put a verl key's value into archer's config ``out`` as its rule says (rename or map), or drop it as no_ops'
    table says (silently, with a warning, or refused)."""
    found = rule_for(key)
    if found is None:
        check_value(no_op_for(key), key, value, source)
        return
    pattern, rule = found
    if isinstance(rule, ValueMapped):
        if value not in rule.values:
            raise ArcherError(f"{source}: {key}={value!r} is not one of {sorted(rule.values, key=str)}",
                              f"set {key} to one of those, or set {rule.to} directly")
        if rule.values[value] is not None:
            OmegaConf.update(out, rule.to, rule.values[value], force_add=True, merge=False)
        return
    target = rule.to + key[len(pattern) - 2:] if pattern.endswith(".*") else rule.to
    OmegaConf.update(out, target, value, force_add=True, merge=False)


def translate(user: DictConfig, known: set[str], open_maps: set[str], closest: Callable[[str], str | None],
              source: str) -> DictConfig:
    """The archer-shaped config of a user's verl-layout config: archer's keys kept, VERL_KEYS applied, any other
    key an error naming the nearest known one (``closest(key)``)."""
    out = OmegaConf.create({})
    _translate(user, "", out, known, open_maps, closest, source)
    return out


def _translate(node: DictConfig, prefix: str, out: DictConfig, known: set[str], open_maps: set[str],
               closest: Callable[[str], str | None], source: str) -> None:
    for k in node.keys():
        key = f"{prefix}.{k}" if prefix else str(k)
        child = node._get_node(k)
        value = child if OmegaConf.is_config(child) else child._value()
        if key in known:
            if key in VERL_VALUES and not OmegaConf.is_config(value) and value in VERL_VALUES[key]:
                value = VERL_VALUES[key][value]
                if value is None:
                    continue
            if isinstance(value, DictConfig) and key not in open_maps and len(value):
                OmegaConf.update(out, key, {}, force_add=True, merge=True)
                _translate(value, key, out, known, open_maps, closest, source)
            else:
                OmegaConf.update(out, key, value, force_add=True, merge=False)
        elif any(key.startswith(m + ".") for m in open_maps):
            OmegaConf.update(out, key, value, force_add=True, merge=False)
        elif rule_for(key) is not None or no_op_for(key) is not None:
            raw = OmegaConf.to_container(value, resolve=False) if OmegaConf.is_config(value) else value
            for leaf, leaf_value in _leaves(raw, key):
                apply_rule(leaf, leaf_value, out, source)
        elif isinstance(value, DictConfig) and is_verl_key(key):
            _translate(value, key, out, known, open_maps, closest, source)
        else:
            near = closest(key)
            hint = f"did you mean {near!r}?" if near else "archer/config/ppo_trainer.yaml lists the keys"
            raise ArcherError(f"{source}: unknown config key {key!r}: {hint}",
                              "fix or drop the key; archer refuses keys it does not know so that no setting is "
                              "silently ignored (docs/porting.md lists verl's keys)")
