"""How the rows of a micro-batch enter the model, padded or packed, and where each response token's score is read
from the model's output.

Rows arrive as a left-padded prompt followed by a right-padded response (width P + R, ``attention_mask`` a
single run of ones, ``position_ids = cumsum(attention_mask) - 1``). Two layouts:

- padded: one row per sequence. By default each row's tokens are moved to its first column and the padding after
  them, the width cut to the longest row (``aligned``): causal attention never lets a token see the padding after
  it, so the rows need no attention mask, and the model runs the flash kernel whatever the lengths (a mask, which
  left padding needs as soon as one row is shorter than another, sends SDPA to a kernel two to three times
  slower on a GPU). Rows that are not one run of tokens starting in the prompt keep their columns and mask;
- packed (verl's ``use_remove_padding``; ``PackedRows``): the sequences concatenated into one row of
  T = sum(lengths) tokens, each with the positions it has in its padded row, and ``cu_seq_lens`` (int32 [B + 1],
  the sequences' offsets) that keep attention inside each sequence (models/packed_attention.py). No padding is
  computed; every real token sees the same tokens at the same positions as in the padded rows, so its hidden
  state is theirs.

The output at flat position c (row-major over the input's rows x columns) scores the token at c + 1, so response
token k of row i is scored at ``first_predictor[i] + k``: ``predictor_index`` gives these positions,
``response_states`` picks the model's outputs there and ``scatter`` puts per-token values back into [B, R] (0
where the response has no token).

A layout is built where the rows are, normally on the CPU, and moved to the GPU whole (``to``): building it reads
lengths and masks back as Python values, and its gathers and scatters use the integer positions it computed
(``response_positions``, ``token_positions``, ``scatter_positions``), never a boolean mask, whose indexing makes
the host wait for the GPU (docs/architecture.md, "The host never waits inside a pass").
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from archer.batch import to_device
from archer.models.packed_attention import all_ones_mask


def first_columns(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B] the column of each row's first token."""
    return attention_mask.bool().int().argmax(dim=1)


def token_runs(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Each row's token count [B] and first token's column [B], and whether every row's tokens are one run."""
    present = attention_mask.bool()
    lengths = present.sum(dim=1)
    first = first_columns(attention_mask)
    last = present.shape[1] - 1 - present.flip(1).int().argmax(dim=1)
    return lengths, first, not bool((lengths != last - first + 1).any())


def left_aligned(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 prompt_width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The rows with their tokens from column 0 and the padding (token 0, positions counting on) after them, cut
    to the longest row, and [B] the column each row's tokens started at; None for no rows, or where a row is
    not one run of tokens that starts in the prompt (or has none)."""
    if not len(input_ids):
        return None
    lengths, first, one_run = token_runs(attention_mask)
    if not one_run or bool((first >= prompt_width).any()) or bool((lengths == 0).any()):
        return None
    columns = torch.arange(int(lengths.max()), device=input_ids.device)
    source = (first[:, None] + columns).clamp(max=input_ids.shape[1] - 1)
    valid = columns < lengths[:, None]
    ids = torch.where(valid, input_ids.gather(1, source), 0)
    last_position = position_ids.gather(1, (first + lengths - 1)[:, None])
    positions = torch.where(valid, position_ids.gather(1, source), last_position + 1 + columns - lengths[:, None])
    return ids, positions, first


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
        lengths, _, one_run = token_runs(attention_mask)
        if not one_run:
            raise ValueError("packed rows need every row to be one run of tokens (attention_mask 1 from its first "
                             "token to its last)")
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=input_ids.device)
        offsets[1:] = lengths.cumsum(0)
        return cls(input_ids[present].unsqueeze(0), position_ids[present].unsqueeze(0), offsets, int(lengths.max()))

    @classmethod
    def of_examples(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
                    ) -> PackedRows:
        """The tokens of rows that each hold several examples one after another (SFT's ``data.packing``): an
        example begins where its position id is 0 (or a row begins); ``attention_mask`` 0 marks the padding."""
        present = attention_mask.bool()
        positions = position_ids[present]
        starts = (positions == 0)
        starts[(present.cumsum(1) == 1)[present]] = True  # each row's first token begins an example
        end = torch.tensor([len(positions)], device=positions.device)
        offsets = torch.cat([starts.nonzero().squeeze(1), end]).to(torch.int32)
        longest = int((offsets[1:] - offsets[:-1]).max()) if len(positions) else 0
        return cls(input_ids[present].unsqueeze(0), positions.unsqueeze(0), offsets, longest)

    def to(self, device: torch.device | str, input_ids: torch.Tensor | None = None) -> PackedRows:
        """The rows on ``device`` (``archer.batch.to_device``: the host does not wait); ``input_ids``: the tokens
        already moved."""
        return PackedRows(to_device(self.input_ids, device) if input_ids is None else input_ids,
                          to_device(self.position_ids, device), to_device(self.cu_seq_lens, device), self.max_length)

    def model_inputs(self) -> dict[str, torch.Tensor | int]:
        """Keyword arguments of the model's forward: an all-ones mask (so transformers makes no mask of its own)
        and the sequences' bounds, which keep attention inside each (models/packed_attention.py)."""
        return {"input_ids": self.input_ids, "attention_mask": all_ones_mask(self.input_ids),
                "position_ids": self.position_ids, "cu_seq_lens_q": self.cu_seq_lens,
                "cu_seq_lens_k": self.cu_seq_lens, "max_length_q": self.max_length, "max_length_k": self.max_length}


@dataclass(frozen=True)
class SequenceLayout:
    """A micro-batch as the model sees it.

    input_ids [B, W] (padded: W the longest row when aligned) or [1, T] (packed); first_predictor [B]: the flat
    position of the output that scores each row's first response token; response_mask [B, R]: where the response
    has a token; padded: the rows' attention_mask (None when aligned: every row starts in column 0 and needs no
    mask) and position_ids; packed: the PackedRows. The gather and scatter positions of the N response tokens
    (flat, in row order) are computed from these when the layout is made.
    """

    input_ids: torch.Tensor
    first_predictor: torch.Tensor
    response_mask: torch.Tensor
    attention_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    packing: PackedRows | None = None
    response_positions: torch.Tensor = field(default=None)  # type: ignore[assignment]  # [N] outputs that score them
    token_positions: torch.Tensor = field(default=None)  # type: ignore[assignment]  # [N] the tokens in input_ids
    scatter_positions: torch.Tensor = field(default=None)  # type: ignore[assignment]  # [N] their places in [B, R]

    def __post_init__(self) -> None:
        if self.response_positions is None:
            last = self.input_ids.numel() - 1
            predictors = self.predictor_index()[self.response_mask]
            object.__setattr__(self, "response_positions", predictors)
            object.__setattr__(self, "token_positions", (predictors + 1).clamp(max=last))
            object.__setattr__(self, "scatter_positions", self.response_mask.reshape(-1).nonzero().squeeze(1))

    @classmethod
    def build(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
              response_length: int, *, packed: bool, aligned: bool = True) -> SequenceLayout:
        """The padded layout of the rows (``aligned``: left-aligned where the rows allow it, else with their
        mask), or (``packed``) the packed one."""
        if response_length <= 0:
            raise ValueError(f"response_length must be positive, got {response_length}")
        rows, width = input_ids.shape
        prompt_width = width - response_length
        response_mask = attention_mask[:, prompt_width:].bool()
        if not packed:
            moved = left_aligned(input_ids, attention_mask, position_ids, prompt_width) if aligned else None
            row_start = torch.arange(rows, device=input_ids.device)
            if moved is None:
                return cls(input_ids, row_start * width + prompt_width - 1, response_mask, attention_mask,
                           position_ids)
            ids, positions, first_column = moved
            first = row_start * ids.shape[1] + prompt_width - first_column - 1
            return cls(ids, first, response_mask, None, positions)
        first_column = first_columns(attention_mask)
        if bool((first_column >= prompt_width).any()):
            raise ValueError("a packed layout needs every row to start with a prompt token")
        rows_packed = PackedRows.of(input_ids, attention_mask, position_ids)
        first = rows_packed.cu_seq_lens[:-1].long() + prompt_width - first_column - 1
        return cls(rows_packed.input_ids, first, response_mask, packing=rows_packed)

    def to(self, device: torch.device | str) -> SequenceLayout:
        """The layout with its tensors on ``device`` (``archer.batch.to_device``: the host does not wait)."""
        return SequenceLayout(**_moved_fields(self, device))

    @property
    def packed(self) -> bool:
        return self.packing is not None

    def model_inputs(self) -> dict[str, torch.Tensor | int]:
        """Keyword arguments of the model's (or backbone's) forward."""
        if self.packing is not None:
            return self.packing.model_inputs()
        mask = all_ones_mask(self.input_ids) if self.attention_mask is None else self.attention_mask
        return {"input_ids": self.input_ids, "attention_mask": mask, "position_ids": self.position_ids}

    def predictor_index(self) -> torch.Tensor:
        """[B, R] flat position of the output that scores each response token (clamped into the input; check
        ``response_mask`` before use)."""
        steps = torch.arange(self.response_mask.shape[1], device=self.first_predictor.device)
        return (self.first_predictor.unsqueeze(1) + steps).clamp(max=self.input_ids.numel() - 1)

    def response_states(self, states: torch.Tensor) -> torch.Tensor:
        """The outputs [N, ...] (``states`` [rows, columns, ...] of the input's shape) that score the N response
        tokens, in row order."""
        return states.reshape(-1, *states.shape[2:]).index_select(0, self.response_positions)

    def response_tokens(self) -> torch.Tensor:
        """The N response tokens [N], in the order of ``response_states``."""
        return self.input_ids.reshape(-1).index_select(0, self.token_positions)

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """Per-token values [N] back into [B, R], 0 where the response has no token."""
        flat = torch.zeros(self.response_mask.numel(), dtype=values.dtype, device=values.device)
        return flat.index_copy(0, self.scatter_positions, values).view(self.response_mask.shape)


def predicted_targets(loss_mask: torch.Tensor, position_ids: torch.Tensor, *, packed: bool) -> torch.Tensor:
    """[B, W - 1]: whether the output at column c scores the token at c + 1, a token with ``loss_mask`` 1; in
    ``packed`` rows never an example's first token (position 0), which nothing of its own example precedes. What
    the SFT loss is normalised by, and what ``ScoredRows`` scores."""
    targets = loss_mask[:, 1:].bool()
    if packed:
        targets &= position_ids[:, 1:] != 0
    return targets


@dataclass(frozen=True)
class ScoredRows:
    """Rows whose scored tokens may lie anywhere in them (SFT's, ``loss_mask`` 1), as the model sees them, and the
    N outputs that score those tokens: ``predictors`` [N], flat positions over the input's rows x columns, and
    ``targets`` [N], the tokens they score.

    Rows run cut after the last column that holds a token: right-padded rows that start in column 0 at position 0
    (``aligned``) with positions counting on over their padding and an all-ones mask (causal attention never lets
    a token see the padding after it), others with their mask and positions; rows that each hold several examples
    (``packed``, positions restarting at 0 with each) as one sequence of examples with their bounds (``packing``),
    or, for a model that does not run archer's attention (``examples=False``), without a mask (transformers then
    builds a [T x T] one from the restarts).
    Built on the host from rows there and moved whole (``to``), like ``SequenceLayout``.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    predictors: torch.Tensor
    targets: torch.Tensor
    attention_mask: torch.Tensor | None = None
    aligned: bool = False
    packing: PackedRows | None = None

    @classmethod
    def build(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
              loss_mask: torch.Tensor, *, packed: bool, examples: bool = True) -> ScoredRows:
        """The layout of rows on the host (rows on a GPU are read back first)."""
        ids, present, positions, learn = (t.cpu() for t in (input_ids, attention_mask.bool(), position_ids, loss_mask))
        if packed and examples:
            packing = PackedRows.of_examples(ids, present, positions)
            begins = torch.zeros(packing.input_ids.shape[1], dtype=torch.bool)
            begins[packing.cu_seq_lens[:-1].long()] = True
            predictors = (learn[present][1:].bool() & ~begins[1:]).nonzero().squeeze(1)  # output c scores c + 1
            return cls(packing.input_ids, packing.position_ids, predictors,
                       packing.input_ids[0].index_select(0, predictors + 1), packing=packing)
        used = present.any(dim=0).nonzero()
        width = int(used[-1]) + 1 if len(used) else 0  # up to the last column that holds a token
        ids, present, positions, learn = (t[:, :width] for t in (ids, present, positions, learn))
        rows, columns = predicted_targets(learn, positions, packed=packed).nonzero(as_tuple=True)
        predictors = rows * width + columns
        targets = ids.reshape(-1).index_select(0, predictors + 1)
        if packed:
            return cls(ids, positions, predictors, targets)
        columns = torch.arange(width)
        starts_at_zero = present == (columns < present.sum(dim=1, keepdim=True))
        if bool(starts_at_zero.all()) and bool((positions == columns)[present].all()):
            return cls(ids, columns.repeat(len(ids), 1), predictors, targets, aligned=True)
        return cls(ids, positions, predictors, targets, attention_mask=present.long())

    def to(self, device: torch.device | str) -> ScoredRows:
        """The layout with its tensors on ``device`` (``archer.batch.to_device``: the host does not wait)."""
        return ScoredRows(**_moved_fields(self, device))

    def model_inputs(self) -> dict[str, torch.Tensor | int | None]:
        """Keyword arguments of the model's (or backbone's) forward."""
        if self.packing is not None:
            return self.packing.model_inputs()
        mask = all_ones_mask(self.input_ids) if self.aligned else self.attention_mask
        return {"input_ids": self.input_ids, "attention_mask": mask, "position_ids": self.position_ids}

    def scored_states(self, states: torch.Tensor) -> torch.Tensor:
        """The outputs [N, ...] (``states`` [rows, columns, ...] of the input's shape) that score the targets."""
        return states.reshape(-1, *states.shape[2:]).index_select(0, self.predictors)


def _moved_fields(layout: SequenceLayout | ScoredRows, device: torch.device | str) -> dict[str, object]:
    """A layout's fields with its tensors on ``device``; its packing's tokens are the layout's input_ids."""
    moved = {f.name: getattr(layout, f.name) for f in fields(layout)}
    for name, value in moved.items():
        if isinstance(value, torch.Tensor):
            moved[name] = to_device(value, device)
    if layout.packing is not None:
        moved["packing"] = layout.packing.to(device, moved["input_ids"])
    return moved
