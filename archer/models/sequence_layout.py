"""How the rows of a micro-batch enter the model, padded or padding-free, and where each response token's
score is read from the model's output.

Rows arrive as a left-padded prompt followed by a right-padded response (width P + R, ``attention_mask`` a
single run of ones, ``position_ids = cumsum(attention_mask) - 1``). Two layouts:

- padded: the rows as they are, with their attention mask;
- padding-free (verl's ``use_remove_padding``): each sequence moved to the start of its row and the row cut
  to the micro-batch's longest sequence. Padding is then only ever after a row's last token, where causal
  attention keeps it from every real token, so the model runs with no attention mask at all (SDPA's
  ``is_causal`` path, flash attention on a GPU) and with the same positions as the padded rows: every real
  token sees the same tokens at the same positions, and its hidden state is the padded path's.

True packing of all rows into one (one row of sum(lengths) tokens and a block-diagonal mask) would remove the
remaining padding too, but without a varlen attention kernel it costs a [T x T] mask and O(T^2) attention in
SDPA, and FlexAttention has no backward on the CPU; bench/padding_free.py measures the three.

The hidden state at column c scores the token at column c + 1, so response token k of a row is scored at
``response_start - 1 + k``: ``predictor_columns`` gives these columns, ``response_states`` picks the model's
outputs there and ``scatter`` puts per-token values back into [B, R] (0 where the response has no token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SequenceLayout:
    """A micro-batch as the model sees it.

    input_ids, position_ids [B, W], attention_mask [B, W] or None (padding-free), response_start [B]: the
    column of each row's first response token, response_mask [B, R]: where the response has a token.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor
    response_start: torch.Tensor
    response_mask: torch.Tensor

    @classmethod
    def build(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
              response_length: int, *, remove_padding: bool) -> SequenceLayout:
        """The padded layout of the rows, or (``remove_padding``) the padding-free one."""
        if response_length <= 0:
            raise ValueError(f"response_length must be positive, got {response_length}")
        width = input_ids.shape[1]
        prompt_width = width - response_length
        response_mask = attention_mask[:, prompt_width:].bool()
        if not remove_padding:
            start = torch.full((input_ids.shape[0],), prompt_width, dtype=torch.long, device=input_ids.device)
            return cls(input_ids, attention_mask, position_ids, start, response_mask)
        present = attention_mask.bool()
        lengths = present.sum(dim=1)
        first = present.int().argmax(dim=1)  # column of each row's first token
        columns = torch.arange(int(lengths.max()), device=input_ids.device)
        inside = columns < lengths.unsqueeze(1)
        source = (first.unsqueeze(1) + columns).clamp(max=width - 1)
        if not bool((present.gather(1, source) | ~inside).all()) or bool((first >= prompt_width).any()):
            raise ValueError("a padding-free layout needs every row to be one run of tokens (attention_mask "
                             "1 from its first prompt token to its last response token)")
        return cls(
            input_ids=torch.where(inside, input_ids.gather(1, source), 0),
            attention_mask=None,
            # the padded rows' positions of the real tokens, continued over the padding after them
            position_ids=position_ids.gather(1, first.unsqueeze(1)) + columns,
            response_start=prompt_width - first,
            response_mask=response_mask,
        )

    def model_inputs(self) -> dict[str, torch.Tensor | None]:
        """Keyword arguments of the backbone's forward."""
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask,
                "position_ids": self.position_ids}

    def predictor_columns(self) -> torch.Tensor:
        """[B, R] column of the output that scores each response token (clamped into the row; check
        ``response_mask`` before use)."""
        size = self.response_mask.shape[1]
        steps = torch.arange(size, device=self.response_start.device)
        return (self.response_start.unsqueeze(1) - 1 + steps).clamp(max=self.input_ids.shape[1] - 1)

    def response_states(self, states: torch.Tensor) -> torch.Tensor:
        """The outputs [N, ...] (``states`` [B, W, ...]) that score the N response tokens, in row order."""
        rows = torch.arange(states.shape[0], device=states.device).unsqueeze(1)
        return states[rows, self.predictor_columns()][self.response_mask]

    def response_tokens(self) -> torch.Tensor:
        """The N response tokens [N], in the order of ``response_states``."""
        columns = self.predictor_columns() + 1
        return self.input_ids.gather(1, columns.clamp(max=self.input_ids.shape[1] - 1))[self.response_mask]

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """Per-token values [N] back into [B, R], 0 where the response has no token."""
        out = torch.zeros(self.response_mask.shape, dtype=values.dtype, device=values.device)
        out[self.response_mask] = values
        return out
