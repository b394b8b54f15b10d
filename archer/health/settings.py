"""The health checks' settings: ``trainer.health.*`` of archer/config/ppo_trainer.yaml, read and checked once.

Each check has its own block of thresholds (``trainer.health.<check>.<key>``, numbers documented in the YAML and
docs/health.md); the keys above the blocks shape every check (the trend windows, the figures' definitions, how
many responses a flag points at). A bad value is an ArcherError naming its key, before any model loads.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from archer.errors import ArcherError

SEVERITIES = ("info", "warning", "critical")
LEVELS = {name: level for level, name in enumerate(SEVERITIES, start=1)}  # 0: no flag
CHECK_NAMES = ("entropy_collapse", "entropy_blowup", "length_hacking", "reward_hacking", "tool_abuse", "no_signal",
               "instability", "staleness", "importance_weights")
_COUNTS = ("window", "horizon", "repetition_ngram")


@dataclass(frozen=True)
class HealthSettings:
    enable: bool
    stop_on: str | None  # the least severe flag that stops the run (None: none does)
    window: int
    horizon: int
    pointers: int
    near_deterministic_entropy: float
    repetition_ngram: int
    accuracy_rise: float
    thresholds: dict[str, dict[str, float]]  # check name -> its block

    @classmethod
    def from_config(cls, node: DictConfig | dict[str, Any]) -> HealthSettings:
        """The settings of a ``trainer.health`` node; ArcherError naming the key of a bad value."""
        raw = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
        stop_on = raw["stop_on"]
        if stop_on not in (None, "warning", "critical"):
            raise ArcherError(f"trainer.health.stop_on={stop_on!r} is not null, warning or critical",
                              "set trainer.health.stop_on=critical (or warning), or null to never stop")
        for key in _COUNTS:
            value = raw[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ArcherError(f"trainer.health.{key}={value!r} must be an integer of at least 1",
                                  f"set trainer.health.{key} to a positive integer")
        pointers = raw["pointers"]
        if not isinstance(pointers, int) or isinstance(pointers, bool) or pointers < 0:
            raise ArcherError(f"trainer.health.pointers={pointers!r} must be an integer of at least 0",
                              "set trainer.health.pointers to 0 (no pointers) or more")
        thresholds = {name: {key: _threshold(f"{name}.{key}", value) for key, value in raw[name].items()}
                      for name in CHECK_NAMES}
        return cls(enable=bool(raw["enable"]), stop_on=stop_on, window=raw["window"], horizon=raw["horizon"],
                   pointers=pointers,
                   near_deterministic_entropy=_threshold("near_deterministic_entropy", raw["near_deterministic_entropy"]),
                   repetition_ngram=raw["repetition_ngram"],
                   accuracy_rise=_threshold("accuracy_rise", raw["accuracy_rise"]), thresholds=thresholds)

    def stops_at(self, severity: str) -> bool:
        """A flag of ``severity`` stops the run (trainer.health.stop_on)."""
        return self.stop_on is not None and LEVELS[severity] >= LEVELS[self.stop_on]


def _threshold(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ArcherError(f"trainer.health.{key}={value!r} must be a finite number of at least 0",
                          f"set trainer.health.{key} to a number (docs/health.md says what it bounds)")
    return float(value)


def default_health_config() -> DictConfig:
    """``trainer.health`` as archer/config/ppo_trainer.yaml defines it (for runs whose config.yaml predates it);
    a copy the caller may change."""
    return copy.deepcopy(_defaults())


@functools.cache
def _defaults() -> DictConfig:
    return OmegaConf.load(Path(__file__).resolve().parents[1] / "config" / "ppo_trainer.yaml").trainer.health
