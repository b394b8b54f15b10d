"""How a worker pass splits its rows into micro-batches and lays each one out (verl's keys).

- fixed: ``*_micro_batch_size_per_gpu`` rows at a time, in batch order (null: the whole batch);
- dynamic (``use_dynamic_bsz``): the rows sorted by length, longest first, and cut into micro-batches whose
  tokens stay within the budget (``*_max_token_len_per_gpu``); a row longer than the budget goes alone.

The tokens of a micro-batch are the ones its forward computes: rows x width. With ``use_remove_padding`` the
width is the longest sequence in the micro-batch (its padding-free layout, models/sequence_layout.py), so
sorting by length leaves little padding; without it, every row is as wide as the padded batch.

Which rows share a micro-batch changes no loss and no metric: the actor and critic normalise every term over
the whole mini-batch and reduce every metric over it (algorithms/aggregation.py, algorithms/metric_sums.py). Only
the choices a loss makes per micro-batch follow the grouping: the top-entropy tokens of entropy_top_ratio, the
class weights of Archer's split KL and AEPO's entropy standardisation (workers/actor_objective.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from archer.batch import Batch
from archer.models.sequence_layout import SequenceLayout


def token_budget_split(lengths: torch.Tensor, max_tokens: int) -> list[torch.Tensor]:
    """Row indices of micro-batches of rows sorted by ``lengths``, longest first, each of at most
    ``max_tokens`` = rows x its longest length (a row longer than the budget alone)."""
    order = torch.argsort(lengths, descending=True, stable=True).tolist()
    sizes = lengths.tolist()
    groups: list[list[int]] = []
    width = 0
    for row in order:
        if groups and (len(groups[-1]) + 1) * width <= max_tokens:
            groups[-1].append(row)
        else:
            groups.append([row])
            width = sizes[row]
    return [torch.tensor(group, dtype=torch.long) for group in groups]


@dataclass(frozen=True)
class MicroBatching:
    """The micro-batches of one pass: ``rows`` per micro-batch (None: all), or with ``max_tokens`` a token
    budget instead; ``remove_padding`` lays each micro-batch out padding-free."""

    rows: int | None
    max_tokens: int | None
    remove_padding: bool

    @classmethod
    def from_config(cls, section: DictConfig, *, size_key: str, dynamic_key: str, budget_key: str,
                    remove_padding: bool) -> MicroBatching:
        """From a config section's verl keys: ``<size_key>_per_gpu`` (else its deprecated global key
        ``<size_key>``, else the whole batch), and ``<budget_key>`` when ``<dynamic_key>`` is on."""
        rows = section[f"{size_key}_per_gpu"] or section[size_key]
        budget = int(section[budget_key]) if section[dynamic_key] else None
        return cls(None if rows is None else int(rows), budget, remove_padding)

    def token_lengths(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B] the width each row takes in a micro-batch: its length, or the padded width."""
        if self.remove_padding:
            return attention_mask.sum(dim=1)
        return torch.full((attention_mask.shape[0],), attention_mask.shape[1], dtype=torch.long)

    def split(self, attention_mask: torch.Tensor) -> list[torch.Tensor]:
        """Row indices of each micro-batch of the rows of ``attention_mask`` (on the CPU)."""
        attention_mask = attention_mask.cpu()
        if self.max_tokens is not None:
            return token_budget_split(self.token_lengths(attention_mask), self.max_tokens)
        return list(torch.arange(attention_mask.shape[0]).split(self.rows or max(attention_mask.shape[0], 1)))

    def layout(self, micro_batch: Batch) -> SequenceLayout:
        """How ``micro_batch`` (input_ids, attention_mask, position_ids, responses) enters the model."""
        return SequenceLayout.build(micro_batch["input_ids"], micro_batch["attention_mask"],
                                    micro_batch["position_ids"], micro_batch["responses"].shape[1],
                                    remove_padding=self.remove_padding)
