"""PromptLoader: reproducible, resumable batches of RL prompts over epochs; collate_prompts: a list of
dataset items to a left-padded Batch the rollout engines take, every item field besides the ids as a row."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from archer.batch import Batch
from archer.errors import ArcherError


class ItemDataset(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> dict[str, Any]: ...


class PromptLoader:
    """Batches of dataset items in a per-epoch order drawn from numpy ``Generator(seed + epoch)`` (or given by
    ``order(epoch)``, a permutation of the dataset's indices).

    ``next_batch()`` returns the next batch and moves into the next epoch after the last one;
    iterating over the loader yields the batches left in the current epoch. ``state_dict()`` /
    ``load_state_dict()`` save and restore the position so a resumed run sees the same batches.
    """

    def __init__(
        self,
        dataset: ItemDataset,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 1,
        drop_last: bool = True,
        order: Callable[[int], np.ndarray] | None = None,
    ) -> None:
        if batch_size <= 0:
            raise ArcherError(f"batch size {batch_size} must be positive", "set data.train_batch_size to 1 or more")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.order = order
        if self.steps_per_epoch == 0:
            raise ArcherError(
                f"the dataset has {len(dataset)} prompts, fewer than one batch of {batch_size}",
                "lower data.train_batch_size, add prompts, or raise data.max_prompt_length if prompts were "
                "filtered as overlong",
            )
        self.epoch = 0
        self.position = 0
        self._order_epoch = -1
        self._order = np.arange(0)

    @property
    def steps_per_epoch(self) -> int:
        """Batches in one epoch."""
        full, rest = divmod(len(self.dataset), self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    @property
    def epochs_done(self) -> int:
        """Epochs whose every batch has been returned (compare with trainer.total_epochs)."""
        return self.epoch

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        for _ in range(self.steps_per_epoch - self.position):
            yield self.next_batch()

    def next_batch(self) -> list[dict[str, Any]]:
        """The next batch; after the last batch of an epoch the loader is at the start of the next."""
        start = self.position * self.batch_size
        indices = self._epoch_order()[start:start + self.batch_size]
        batch = [self.dataset[int(i)] for i in indices]
        self.position += 1
        if self.position == self.steps_per_epoch:
            self.epoch += 1
            self.position = 0
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.steps_per_epoch:
            raise ArcherError(
                f"the saved data position (epoch {epoch}, batch {position}) does not fit this loader "
                f"({self.steps_per_epoch} batches per epoch)",
                "resume with the same data files, data.train_batch_size and max_prompt_length as the "
                "checkpointed run, or start a fresh run",
            )
        self.epoch, self.position = epoch, position

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            n = len(self.dataset)
            if not self.shuffle:
                self._order = np.arange(n)
            elif self.order is not None:
                self._order = self.order(self.epoch)
            else:
                self._order = np.random.default_rng(self.seed + self.epoch).permutation(n)
            self._order_epoch = self.epoch
        return self._order


def collate_prompts(items: Sequence[dict[str, Any]], pad_token_id: int) -> Batch:
    """A Batch of prompts: input_ids left-padded to the longest, attention_mask, position_ids, and as rows
    every other field of the items (RLDataset's raw_prompt, data_source, ability, ground_truth, extra_info,
    index and the data.reward_fn_key column)."""
    if not items:
        raise ValueError("collate_prompts needs at least one item")
    width = max(len(item["prompt_ids"]) for item in items)
    input_ids = torch.full((len(items), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(items), width), dtype=torch.long)
    for r, item in enumerate(items):
        ids = item["prompt_ids"]
        input_ids[r, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        attention_mask[r, width - len(ids):] = 1
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    tensors = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    rows = {key: [item[key] for item in items] for key in items[0] if key != "prompt_ids"}
    return Batch(tensors, rows)
