"""How the rows of a micro-batch enter the model, padded or packed, and where each response token's score is read
from the model's output.

Rows arrive as a left-padded prompt followed by a right-padded response (width P + R, ``attention_mask`` a
single run of ones, ``position_ids = cumsum(attention_mask) - 1``). Two layouts:

- padded: the rows as they are, with their attention mask;
- packed (verl's ``use_remove_padding``; ``PackedRows``): the sequences concatenated into one row of
  T = sum(lengths) tokens, each with the positions it has in its padded row, and ``cu_seq_lens`` (int32 [B + 1],
  the sequences' offsets) that keep attention inside each sequence (models/packed_attention.py). No padding is
  computed; every real token sees the same tokens at the same positions as in the padded rows, so its hidden
  state is theirs.

The output at flat position c (row-major over the input's rows x columns) scores the token at c + 1, so response
token k of row i is scored at ``first_predictor[i] + k``: ``predictor_index`` gives these positions,
``response_states`` picks the model's outputs there and ``scatter`` puts per-token values back into [B, R] (0
where the response has no token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedRows:
    """Rows (each one run of tokens in its padded row) concatenated into one row: input_ids, position_ids [1, T],
    cu_seq_lens [S + 1] (int32, the sequences' offsets) and max_length (the longest sequence)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seq_lens: torch.Tensor
    max_length: int

    @classmethod
    def of(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> PackedRows:
        """The tokens of the padded rows where ``attention_mask`` is 1, with their positions (ValueError when a
        row's tokens are not one run)."""
        present = attention_mask.bool()
        lengths = present.sum(dim=1)
        first = present.int().argmax(dim=1)
        last = present.shape[1] - 1 - present.flip(1).int().argmax(dim=1)
        if bool((lengths != last - first + 1).any()):
            raise ValueError("packed rows need every row to be one run of tokens (attention_mask 1 from its first "
                             "token to its last)")
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=input_ids.device)
        offsets[1:] = lengths.cumsum(0)
        return cls(input_ids[present].unsqueeze(0), position_ids[present].unsqueeze(0), offsets, int(lengths.max()))

    def model_inputs(self) -> dict[str, torch.Tensor | int]:
        """Keyword arguments of the model's forward: an all-ones mask (so transformers makes no mask of its own)
        and the sequences' bounds, which keep attention inside each (models/packed_attention.py)."""
        return {"input_ids": self.input_ids, "attention_mask": torch.ones_like(self.input_ids),
                "position_ids": self.position_ids, "cu_seq_lens_q": self.cu_seq_lens,
                "cu_seq_lens_k": self.cu_seq_lens, "max_length_q": self.max_length, "max_length_k": self.max_length}


@dataclass(frozen=True)
class SequenceLayout:
    """A micro-batch as the model sees it.

    input_ids [B, W] (padded) or [1, T] (packed); first_predictor [B]: the flat position of the output that scores
    each row's first response token; response_mask [B, R]: where the response has a token; padded: the rows'
    attention_mask and position_ids; packed: the PackedRows.
    """

    input_ids: torch.Tensor
    first_predictor: torch.Tensor
    response_mask: torch.Tensor
    attention_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    packing: PackedRows | None = None

    @classmethod
    def build(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
              response_length: int, *, packed: bool) -> SequenceLayout:
        """The padded layout of the rows, or (``packed``) the packed one."""
        if response_length <= 0:
            raise ValueError(f"response_length must be positive, got {response_length}")
        rows, width = input_ids.shape
        prompt_width = width - response_length
        response_mask = attention_mask[:, prompt_width:].bool()
        if not packed:
            first = torch.arange(rows, device=input_ids.device) * width + prompt_width - 1
            return cls(input_ids, first, response_mask, attention_mask, position_ids)
        first_column = attention_mask.bool().int().argmax(dim=1)
        if bool((first_column >= prompt_width).any()):
            raise ValueError("a packed layout needs every row to start with a prompt token")
        rows_packed = PackedRows.of(input_ids, attention_mask, position_ids)
        first = rows_packed.cu_seq_lens[:-1].long() + prompt_width - first_column - 1
        return cls(rows_packed.input_ids, first, response_mask, packing=rows_packed)

    @property
    def packed(self) -> bool:
        return self.packing is not None

    def model_inputs(self) -> dict[str, torch.Tensor | int]:
        """Keyword arguments of the model's (or backbone's) forward."""
        if self.packing is not None:
            return self.packing.model_inputs()
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "position_ids": self.position_ids}

    def predictor_index(self) -> torch.Tensor:
        """[B, R] flat position of the output that scores each response token (clamped into the input; check
        ``response_mask`` before use)."""
        steps = torch.arange(self.response_mask.shape[1], device=self.first_predictor.device)
        return (self.first_predictor.unsqueeze(1) + steps).clamp(max=self.input_ids.numel() - 1)

    def response_states(self, states: torch.Tensor) -> torch.Tensor:
        """The outputs [N, ...] (``states`` [rows, columns, ...] of the input's shape) that score the N response
        tokens, in row order."""
        flat = states.reshape(-1, *states.shape[2:])
        return flat[self.predictor_index()[self.response_mask]]

    def response_tokens(self) -> torch.Tensor:
        """The N response tokens [N], in the order of ``response_states``."""
        index = (self.predictor_index() + 1).clamp(max=self.input_ids.numel() - 1)
        return self.input_ids.reshape(-1)[index[self.response_mask]]

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """Per-token values [N] back into [B, R], 0 where the response has no token."""
        out = torch.zeros(self.response_mask.shape, dtype=values.dtype, device=values.device)
        out[self.response_mask] = values
        return out
