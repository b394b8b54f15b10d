"""How many ranks a run's config asks for: one rule that the config checks, the no-op table, the trainer and
the rank's workers share (it imports nothing of archer, so every config module may use it)."""

from __future__ import annotations

from omegaconf import DictConfig


def world_size(trainer: DictConfig) -> int:
    """The number of ranks of a run: ``trainer.nnodes`` x ``trainer.n_gpus_per_node`` (``trainer``: the config's
    ``trainer`` section)."""
    return int(trainer.nnodes) * int(trainer.n_gpus_per_node)
