"""How a worker pass splits its rows into micro-batches and lays each one out (verl's keys).

- fixed: ``*_micro_batch_size_per_gpu`` rows at a time, in batch order (null: the whole batch);
- by tokens (``use_dynamic_bsz``): micro-batches whose tokens stay within the budget (``*_max_token_len_per_gpu``);
  a row longer than the budget goes alone.

The tokens of a micro-batch are the ones its forward computes. Packed (``use_remove_padding``,
models/sequence_layout.py) that is the sum of its rows' lengths, and the rows are packed first-fit, longest
first; padded, every row is as wide as the padded batch, so the budget holds budget // width rows, in order.

No-grad passes (old log-probs, reference log-probs, values, reward-model scores) are packed to a token budget by
default, whatever their micro-batch keys say (``no_grad_micro_batching``): their results do not depend on the
grouping, and one row per pass runs a GPU far below its limit. The budget is the pass's own
``*_max_token_len_per_gpu`` when its ``*use_dynamic_bsz`` is on, else the memory plan's (workers/memory.py) on a
GPU, else the budget key's value. The section's ``*_by_tokens: false`` keeps its micro-batch keys exactly.

Which rows share a micro-batch changes no loss and no metric: the actor and critic normalise every term over
the whole mini-batch and reduce every metric over it (algorithms/aggregation.py, algorithms/metric_sums.py). Only
the choices a loss makes per micro-batch follow the grouping: the top-entropy tokens of entropy_top_ratio, the
class weights of Archer's split KL and AEPO's entropy standardisation (workers/actor_objective.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from archer.batch import Batch
from archer.models.sequence_layout import SequenceLayout

log = logging.getLogger("archer.micro_batches")


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


def packed_budget_split(lengths: torch.Tensor, max_tokens: int) -> list[torch.Tensor]:
    """Row indices of micro-batches whose ``lengths`` add up to at most ``max_tokens``: first-fit decreasing
    (each row, longest first, joins the first micro-batch it fits in; a row longer than the budget alone)."""
    order = torch.argsort(lengths, descending=True, stable=True).tolist()
    sizes = lengths.tolist()
    groups: list[list[int]] = []
    room: list[int] = []
    for row in order:
        fit = next((g for g, left in enumerate(room) if sizes[row] <= left), None)
        if fit is None:
            groups.append([row])
            room.append(max_tokens - sizes[row])
        else:
            groups[fit].append(row)
            room[fit] -= sizes[row]
    return [torch.tensor(group, dtype=torch.long) for group in groups]


@dataclass(frozen=True)
class PassKeys:
    """The names of a pass's micro-batch keys in its config section: rows (``<size>_per_gpu``, else the
    deprecated ``<size>``), the token-budget switch and budget, and for a no-grad pass archer's ``by_tokens``."""

    size: str
    dynamic: str
    budget: str
    by_tokens: str | None = None


ACTOR_UPDATE = PassKeys("ppo_micro_batch_size", "use_dynamic_bsz", "ppo_max_token_len_per_gpu")
LOG_PROB = PassKeys("log_prob_micro_batch_size", "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu",
                    "log_prob_by_tokens")  # rollout (old log-probs) and ref sections
CRITIC_UPDATE = PassKeys("ppo_micro_batch_size", "use_dynamic_bsz", "ppo_max_token_len_per_gpu")
CRITIC_VALUES = PassKeys("forward_micro_batch_size", "use_dynamic_bsz", "forward_max_token_len_per_gpu",
                         "forward_by_tokens")
REWARD_MODEL = PassKeys("micro_batch_size", "use_dynamic_bsz", "forward_max_token_len_per_gpu", "forward_by_tokens")


@dataclass(frozen=True)
class MicroBatching:
    """The micro-batches of one pass: ``rows`` per micro-batch (None: all), or with ``max_tokens`` a token
    budget instead; ``packed`` lays each micro-batch out as one row of its sequences."""

    rows: int | None
    max_tokens: int | None
    packed: bool

    @classmethod
    def from_config(cls, section: DictConfig, keys: PassKeys, *, packed: bool) -> MicroBatching:
        """From a config section's verl keys: the rows it sets (else the whole batch), and its budget when its
        token-budget switch is on."""
        budget = int(section[keys.budget]) if section[keys.dynamic] else None
        return cls(configured_rows(section, keys.size), budget, packed)

    def token_lengths(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B] the tokens each row takes in a micro-batch: its length, or the padded width."""
        if self.packed:
            return attention_mask.sum(dim=1)
        return torch.full((attention_mask.shape[0],), attention_mask.shape[1], dtype=torch.long)

    def split(self, attention_mask: torch.Tensor) -> list[torch.Tensor]:
        """Row indices of each micro-batch of the rows of ``attention_mask`` (on the CPU)."""
        attention_mask = attention_mask.cpu()
        if self.max_tokens is not None:
            cut = packed_budget_split if self.packed else token_budget_split
            return cut(self.token_lengths(attention_mask), self.max_tokens)
        return list(torch.arange(attention_mask.shape[0]).split(self.rows or max(attention_mask.shape[0], 1)))

    def layout(self, micro_batch: Batch) -> SequenceLayout:
        """How ``micro_batch`` (input_ids, attention_mask, position_ids, responses) enters the model."""
        return SequenceLayout.build(micro_batch["input_ids"], micro_batch["attention_mask"],
                                    micro_batch["position_ids"], micro_batch["responses"].shape[1],
                                    packed=self.packed)


def configured_rows(section: DictConfig, size_key: str) -> int | None:
    """The rows per micro-batch a section's keys set: ``<size_key>_per_gpu``, else ``<size_key>``, else None."""
    rows = section[f"{size_key}_per_gpu"] or section[size_key]
    return None if rows is None else int(rows)


def no_grad_micro_batching(section: DictConfig, where: str, keys: PassKeys, *, remove_padding: bool, can_pack: bool,
                           planned_tokens: int | None, announce: bool) -> MicroBatching:
    """The micro-batches of a no-grad pass over config ``section`` (its full name ``where``, e.g.
    ``actor_rollout_ref.rollout``).

    With the section's ``by_tokens`` key on, its rows are packed (when the model ``can_pack``: it runs archer's
    attention) into micro-batches of a token budget: the section's budget when its token-budget switch is on,
    else ``planned_tokens`` (the memory plan's), else the budget key's value; when that replaces rows per
    micro-batch the keys set, a warning says so (``announce``: this process speaks for the run). Off: the
    section's keys exactly, packed as ``use_remove_padding`` (``remove_padding``) says.
    """
    keyed = MicroBatching.from_config(section, keys, packed=remove_padding and can_pack)
    if not section[keys.by_tokens]:
        return keyed
    budget = keyed.max_tokens or planned_tokens or int(section[keys.budget])
    rows = configured_rows(section, keys.size)
    if announce and rows is not None and keyed.max_tokens is None:
        key = f"{keys.size}_per_gpu" if section[f"{keys.size}_per_gpu"] else keys.size
        log.warning("%s.%s=%d is not used: this no-grad pass packs its rows into micro-batches of at most %d tokens "
                    "instead (the same results, far fewer passes); set %s.%s=false to keep micro-batches of %d row%s",
                    where, key, rows, budget, where, keys.by_tokens, rows, "" if rows == 1 else "s")
    return MicroBatching(None, budget, packed=can_pack)
