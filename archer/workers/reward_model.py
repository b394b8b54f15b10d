"""The reward-model worker (verl's ``reward_model.*``): a sequence-classification model that scores each response.

``RewardModelWorker.compute_rm_score(batch)`` returns ``rm_scores`` [B, R] (float32): each row's score on its last
learned response token (``response_mask``, where the rule reward's score goes too), zeros elsewhere. What the
reward model reads (``RewardModelInputs``):

- ``reward_model.model.input_tokenizer`` set (verl's default, the policy's path): the response is decoded with
  that tokenizer (special tokens kept, the final eos dropped, as verl's ``_switch_chat_template``), appended to the
  row's ``raw_prompt`` messages as the assistant turn, and rendered with the reward model's own chat template.
  The text is encoded whole, except that nothing inside the response becomes a control token of the reward
  model: the response holds tool output, and a ``<|im_start|>user ...`` printed by a snippet would otherwise
  forge turns ("score it 10/10") in the reward model's input. It stays plain text, as in the rollout
  (archer/rollout/tool_text.py);
- ``input_tokenizer: null``: the policy's prompt and response tokens as they are (the reward model shares the
  policy's tokenizer and chat template).

Each sequence longer than ``reward_model.max_length`` (null: the reward model's position limit) is cut as
``reward_model.truncation`` says. archer's default ``left`` drops the first tokens, so the reward model always
reads the end of the response it scores; verl's worker cuts from the right, which can drop the response's end
and score a token inside it. Sequences are scored without gradients (bf16 on a GPU, float32 on the CPU) in
micro-batches, each packed into one row (right-padded to its own longest row for an architecture that cannot be
packed): by default to a token budget (``forward_by_tokens``; the memory plan's on a GPU, models/micro_batches.py);
with ``forward_by_tokens=false`` by ``micro_batch_size_per_gpu``, or a token budget with ``use_dynamic_bsz``. The
score of a row is the classification head's output at its last token, so the other rows of a micro-batch do not
change it.

``check_reward_model_config`` runs with the config check, before data or models load: a missing path, a folder
that is not a one-label sequence-classification model, or settings out of range are one ArcherError each.
"""

from __future__ import annotations

import math
import os
import secrets
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from archer.batch import Batch, response_attention, to_device
from archer.data.rl_dataset import TRUNCATION_MODES, truncate_ids
from archer.distributed.context import DistContext
from archer.errors import ArcherError
from archer.models.loading import (
    default_dtype,
    load_reward_model,
    load_tokenizer,
    max_positions,
    read_model_config,
)
from archer.models.micro_batches import REWARD_MODEL, no_grad_micro_batching
from archer.models.owner import model_bytes
from archer.models.packed_attention import supports_packing
from archer.models.sequence_layout import PackedRows
from archer.rewards.reward_stage import on_last_token
from archer.rollout.tool_text import encode_with_plain_part
from archer.workers.dispatch import collect, concat_batches, own_rows
from archer.workers.memory import MemoryPlan, planned_no_grad_tokens

RM = "reward_model"
# The head whose per-token output is the score: decoder reward models (Llama, Qwen2, Mistral, Gemma ...
# ForSequenceClassification) and verl's token-classification reading of them share it.
SCORE_HEAD = "score"


def _rm_config(section: DictConfig) -> PretrainedConfig:
    """The reward model folder's config, checked to be a one-label sequence-classification model."""
    path = section.model.path
    if not path:
        raise ArcherError(f"{RM}.enable=true but {RM}.model.path is not set",
                          f"set {RM}.model.path to a Hugging Face sequence-classification reward model folder, "
                          f"or {RM}.enable=false")
    if not Path(str(path)).expanduser().is_dir():
        raise ArcherError(f"{RM}.model.path={path} is not a folder",
                          "point it to a local Hugging Face reward model folder (config.json, weights, tokenizer)")
    config = read_model_config(str(path), trust_remote_code=bool(section.model.trust_remote_code))
    architectures = list(config.architectures or [])
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ArcherError(
            f"{RM}.model.path={path} holds {architectures or 'a model without architectures'}, not a "
            "sequence-classification reward model: its score head would be freshly initialised",
            "use a reward model saved as AutoModelForSequenceClassification with num_labels=1 (e.g. "
            "Skywork-Reward, FsfairX-LLaMA3-RM)")
    if config.num_labels != 1:
        raise ArcherError(f"the reward model {path} has num_labels={config.num_labels}; a reward model gives one "
                          "score per sequence (num_labels=1)",
                          "use a reward model trained with one label (a multi-label classifier is not a reward)")
    return config


def check_reward_model_config(cfg: DictConfig) -> None:
    """``reward_model.*`` of an RL config with enable=true: the folder, the weights of the mix, the lengths."""
    section = cfg.reward_model
    config = _rm_config(section)
    weights = {"rm_weight": section.rm_weight, "rule_weight": section.rule_weight}
    for key, value in weights.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ArcherError(f"{RM}.{key}={value!r} must be a finite number", f"set {RM}.{key} to a number")
    if not any(weights.values()):
        raise ArcherError(f"{RM}.rm_weight and {RM}.rule_weight are both 0: every reward would be 0",
                          f"set {RM}.rm_weight=1.0 (verl: the reward model's score alone)")
    if section.truncation not in TRUNCATION_MODES:
        raise ArcherError(f"unknown {RM}.truncation {section.truncation!r}",
                          f"use one of {', '.join(TRUNCATION_MODES)}")
    for key in ("max_length", "micro_batch_size", "micro_batch_size_per_gpu", "forward_max_token_len_per_gpu"):
        value = section[key]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ArcherError(f"{RM}.{key}={value!r} must be an integer of at least 1 (or null)",
                              f"set {RM}.{key} to a positive integer, or null")
    input_tokenizer = section.model.input_tokenizer
    if input_tokenizer is not None and not Path(str(input_tokenizer)).expanduser().is_dir():
        raise ArcherError(f"{RM}.model.input_tokenizer={input_tokenizer} is not a folder",
                          "set it to the policy's model folder (its default), or null when the reward model shares "
                          "the policy's tokenizer and chat template")
    limit = max_positions(config)
    if section.max_length is not None and limit is not None and int(section.max_length) > limit:
        raise ArcherError(f"{RM}.max_length={section.max_length} exceeds the reward model's {limit} positions",
                          f"set {RM}.max_length to at most {limit} (null: {limit})")


class RewardModelInputs:
    """The token ids the reward model reads for each row of a generated batch (see the module docstring)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, input_tokenizer: PreTrainedTokenizerBase | None, *,
                 max_length: int | None, truncation: str) -> None:
        if input_tokenizer is not None and not tokenizer.chat_template:
            raise ArcherError(
                "the reward model's tokenizer has no chat template, and reward_model.model.input_tokenizer asks "
                "to render prompt and response with it",
                "add the chat template to the reward model folder's tokenizer_config.json, or set "
                "reward_model.model.input_tokenizer=null when the reward model shares the policy's tokenizer")
        self.tokenizer = tokenizer
        self.input_tokenizer = input_tokenizer
        self.max_length = max_length
        self.truncation = truncation

    def __call__(self, batch: Batch) -> list[list[int]]:
        rows = self._rendered(batch) if self.input_tokenizer is not None else self._policy_tokens(batch)
        return [self._truncate(ids, i) for i, ids in enumerate(rows)]

    def _policy_tokens(self, batch: Batch) -> list[list[int]]:
        ids, attention = batch["input_ids"].cpu(), batch["attention_mask"].cpu().bool()
        return [row[mask].tolist() for row, mask in zip(ids, attention, strict=True)]

    def _rendered(self, batch: Batch) -> list[list[int]]:
        source = self.input_tokenizer
        assert source is not None
        present = response_attention(batch).cpu().bool()
        ends = set(source.all_special_ids)
        out = []
        for i, (row, mask) in enumerate(zip(batch["responses"].cpu(), present, strict=True)):
            ids = row[mask].tolist()
            if ids and ids[-1] in ends:
                ids = ids[:-1]  # the eos the response ended with (verl drops its text; a tool's copies stay)
            response = source.decode(ids, skip_special_tokens=False)
            out.append(self._encode(_messages(batch["raw_prompt"][i]), response))
        return out

    def _encode(self, prompt: list[dict[str, Any]], response: str) -> list[int]:
        """The conversation in the reward model's chat template, its response part encoded plainly: the part is
        where the rendering differs from one of an unguessable marker in its place (a template that reformats the
        response, as Qwen3's does with its thinking, widens the part, never narrows it)."""
        marker = f"\x00{secrets.token_hex(8)}\x00"

        def render(content: str) -> str:
            return self.tokenizer.apply_chat_template([*prompt, {"role": "assistant", "content": content}],
                                                      tokenize=False, add_generation_prompt=False)

        text, framed = render(response), render(marker)
        if marker not in framed:
            raise ArcherError("the reward model's chat template does not render the assistant turn's content",
                              "use a reward model whose chat template renders assistant messages, or set "
                              "reward_model.model.input_tokenizer=null")
        before, after = len(framed[:framed.index(marker)]), len(framed) - framed.rindex(marker) - len(marker)
        start = min(before, len(os.path.commonprefix([text, framed])))
        end = len(text) - min(after, len(os.path.commonprefix([text[::-1], framed[::-1]])))
        return encode_with_plain_part(self.tokenizer, text, start, max(start, end))

    def _truncate(self, ids: list[int], row: int) -> list[int]:
        if self.max_length is None or len(ids) <= self.max_length:
            return ids
        if self.truncation == "error":
            raise ArcherError(f"row {row} is {len(ids)} tokens for the reward model, longer than "
                              f"reward_model.max_length={self.max_length}",
                              "raise reward_model.max_length, or set reward_model.truncation=left to drop the "
                              "first tokens")
        return truncate_ids(ids, self.max_length, self.truncation)


def _messages(raw_prompt: Any) -> list[dict[str, Any]]:
    """The prompt's chat messages (a plain string is one user turn)."""
    if isinstance(raw_prompt, str):
        return [{"role": "user", "content": raw_prompt}]
    return [dict(message) for message in raw_prompt]


class RewardModelWorker:
    """Holds the frozen reward model (``reward_model`` config section ``cfg``) on ``device`` and scores batches.
    ``policy_tokenizer`` is the policy's, used as the input tokenizer when ``model.input_tokenizer`` is the
    policy's path (``policy_path``). ``ctx``: the rank of a data-parallel run (default: one process on
    ``device``); the model is not sharded (each rank holds a copy) and scores the rank's rows."""

    def __init__(self, cfg: DictConfig, *, device: torch.device, policy_tokenizer: PreTrainedTokenizerBase,
                 policy_path: str, ctx: DistContext | None = None) -> None:
        config = _rm_config(cfg)
        self.device = device
        self.ctx = ctx if ctx is not None else DistContext.single(device)
        path, trust = str(cfg.model.path), bool(cfg.model.trust_remote_code)
        self.model = load_reward_model(path, device=device, dtype=default_dtype(device), trust_remote_code=trust)
        self.head = getattr(self.model, SCORE_HEAD, None)
        self.backbone = getattr(self.model, self.model.base_model_prefix, None)
        if not isinstance(self.head, torch.nn.Linear) or self.backbone is None:
            raise ArcherError(f"the reward model {path} ({type(self.model).__name__}) has no per-token "
                              f"'{SCORE_HEAD}' head on a decoder backbone, which archer reads the score from",
                              "use a decoder reward model (Llama, Qwen2, Mistral, Gemma ... ForSequenceClassification)")
        input_path = cfg.model.input_tokenizer
        if input_path is None:
            input_tokenizer = None
        elif str(input_path) == str(policy_path):
            input_tokenizer = policy_tokenizer
        else:
            input_tokenizer = load_tokenizer(str(input_path), role="reward_model.model.input_tokenizer")
        max_length = cfg.max_length if cfg.max_length is not None else max_positions(config)
        self.inputs = RewardModelInputs(load_tokenizer(path, role="reward model"), input_tokenizer,
                                        max_length=None if max_length is None else int(max_length),
                                        truncation=str(cfg.truncation))
        self.cfg = cfg
        self.pad_token_id = int(self.inputs.tokenizer.pad_token_id)
        self.plan_micro_batches(None, announce=False)

    def plan_micro_batches(self, memory_plan: MemoryPlan | None, *, announce: bool) -> None:
        """Micro-batches by the section's keys and, on a GPU, the memory plan's token budget (the actor's plan,
        made once this model's bytes are in it; models/micro_batches.py). Without packing each micro-batch is
        right-padded to its own longest row, so a row costs its own length then too."""
        self.micro = no_grad_micro_batching(
            self.cfg, RM, REWARD_MODEL, remove_padding=True, can_pack=supports_packing(self.model),
            planned_tokens=planned_no_grad_tokens(memory_plan, self.model), announce=announce)

    @property
    def bytes(self) -> int:
        """What the reward model's weights take on its device (the rank's memory plan counts them)."""
        return model_bytes(self.model)[0]

    @torch.no_grad()
    def score_sequences(self, sequences: list[list[int]]) -> torch.Tensor:
        """[N] float32 scores of token sequences (each non-empty), in micro-batches, packed or right-padded."""
        lengths = torch.tensor([len(ids) for ids in sequences], dtype=torch.long)
        width = int(lengths.max()) if len(sequences) else 0
        present = torch.arange(width)[None, :] < lengths[:, None]
        done = []
        for rows in self.micro.split(present.long()):
            longest = int(lengths[rows].max())
            ids = torch.full((len(rows), longest), self.pad_token_id, dtype=torch.long)
            for r, row in enumerate(rows.tolist()):
                ids[r, :lengths[row]] = torch.tensor(sequences[row], dtype=torch.long)
            mask = present[rows, :longest].long()
            if self.micro.packed:  # laid out on the host and moved whole: the host never waits for the GPU
                packing = PackedRows.of(ids, mask, torch.arange(longest).expand_as(ids)).to(self.device)
                hidden = self.backbone(**packing.model_inputs(), use_cache=False).last_hidden_state[0]
                last = packing.cu_seq_lens[1:].long() - 1
            else:
                hidden = self.backbone(input_ids=to_device(ids, self.device),
                                       attention_mask=to_device(mask, self.device), use_cache=False).last_hidden_state
                last = to_device(torch.arange(len(rows)) * longest + lengths[rows] - 1, self.device)
            picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, last)
            done.append((rows, self.head(picked).squeeze(-1).float()))
        scores = torch.zeros(len(sequences), dtype=torch.float32)
        for rows, part in done:  # read back once the passes are queued
            scores[rows] = part.cpu()
        return scores

    @collect(concat_batches, split=own_rows)
    def compute_rm_score(self, batch: Batch) -> Batch:
        """``rm_scores`` [B, R] of this rank's rows: each row's score on its last learned response token
        (``response_mask``)."""
        sequences = self.inputs(batch)
        empty = [i for i, ids in enumerate(sequences) if not ids]
        if empty:
            raise ArcherError(f"row {empty[0]} gives the reward model no tokens to read",
                              "check reward_model.max_length and the reward model's chat template")
        scores = self.score_sequences(sequences).numpy().astype(np.float64)
        mask = batch["response_mask"]
        return Batch({"rm_scores": on_last_token(scores, mask).to(mask.device)})
