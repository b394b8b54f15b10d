"""RLDataset: RL prompt rows rendered with a chat template and tokenised once, with overlong prompts
filtered or truncated as verl's ``data.filter_overlong_prompts`` and ``data.truncation`` say."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import jinja2
from transformers import PreTrainedTokenizerBase

from archer.errors import ArcherError

logger = logging.getLogger("archer.data")

TRUNCATION_MODES = ("error", "left", "right", "middle")
# The fix of a prompt longer than max_prompt_length (truncation=error, no filtering); {longest}: the longest prompt.
OVERLONG_FIX = ("raise data.max_prompt_length (to {longest} keeps every prompt whole), set "
                "data.filter_overlong_prompts=True to drop such prompts, or data.truncation=left|right|middle to cut them")


def truncate_ids(ids: list[int], max_length: int, mode: str) -> list[int]:
    """``ids`` cut to ``max_length``: keep the end (left), the start (right) or both ends (middle)."""
    if len(ids) <= max_length:
        return ids
    if mode == "left":
        return ids[len(ids) - max_length:]
    if mode == "right":
        return ids[:max_length]
    if mode == "middle":
        head = max_length // 2
        return ids[:head] + ids[len(ids) - (max_length - head):]
    raise ValueError(f"truncate_ids: unknown mode {mode!r}")


class RLDataset:
    """Tokenised RL prompts; item ``i`` is a dict with prompt_ids, raw_prompt, data_source, ability,
    ground_truth (``reward_model.ground_truth``, None when the row has none), extra_info, tools (the tool names
    the row may call, None for every tool), index (the row's position in the rows given) and, when it is
    another column, the ``reward_fn_key`` column the reward routes on."""

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_prompt_length: int,
        truncation: str = "error",
        filter_overlong_prompts: bool = True,
        prompt_key: str = "prompt",
        reward_fn_key: str = "data_source",
        chat_template: str | None = None,
        apply_chat_template_kwargs: dict[str, Any] | None = None,
        where: str = "",
        overlong_fix: str = OVERLONG_FIX,
    ) -> None:
        """``where`` names the rows' source in errors (a file, a benchmark); ``overlong_fix`` is the fix of the
        error for a prompt longer than max_prompt_length (truncation=error, unfiltered), in the command's own
        keys (``{longest}``: the longest prompt's tokens)."""
        if truncation not in TRUNCATION_MODES:
            raise ArcherError(
                f"data.truncation={truncation!r} is not a truncation mode",
                f"use one of {list(TRUNCATION_MODES)}",
            )
        if max_prompt_length <= 0:
            raise ArcherError(
                f"data.max_prompt_length={max_prompt_length} must be positive",
                "set data.max_prompt_length to the longest prompt (in tokens) the model should see",
            )
        self.max_prompt_length = max_prompt_length
        self.where = f"{where}: " if where else ""
        self.overlong_fix = overlong_fix
        self.num_filtered = 0
        self.num_truncated = 0
        texts = self._render(rows, tokenizer, prompt_key, chat_template, apply_chat_template_kwargs or {})
        all_ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        self._items: list[dict[str, Any]] = []
        self.longest_row = max(map(len, all_ids), default=0)  # tokens of the longest prompt, before any cut
        for index, (row, ids) in enumerate(zip(rows, all_ids, strict=True)):
            kept = self._fit(ids, index, truncation, filter_overlong_prompts)
            if kept is not None:
                self._items.append(_item(row, kept, index, prompt_key, reward_fn_key))
        self._log(len(rows), truncation)
        if not self._items:
            raise ArcherError(
                f"no prompt is left: all {len(rows)} rows are longer than "
                f"data.max_prompt_length={max_prompt_length} tokens and were filtered",
                "raise data.max_prompt_length, or set data.filter_overlong_prompts=False with "
                "data.truncation=left|right|middle",
            )

    def __len__(self) -> int:
        return len(self._items)

    @property
    def longest_prompt(self) -> int:
        """Tokens of the longest prompt kept (after filtering and truncation)."""
        return max(len(item["prompt_ids"]) for item in self._items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self._items[i]

    @staticmethod
    def _render(
        rows: Sequence[dict[str, Any]],
        tokenizer: PreTrainedTokenizerBase,
        prompt_key: str,
        chat_template: str | None,
        template_kwargs: dict[str, Any],
    ) -> list[str]:
        if chat_template is None and not tokenizer.chat_template:
            raise ArcherError(
                f"the tokenizer ({tokenizer.name_or_path or type(tokenizer).__name__}) has no chat template",
                "use a chat/instruct model, or set actor_rollout_ref.model.custom_chat_template to a Jinja "
                "template string",
            )
        def render(i: int, kwargs: dict[str, Any]) -> str:
            try:
                return tokenizer.apply_chat_template(rows[i][prompt_key], chat_template=chat_template,
                                                     add_generation_prompt=True, tokenize=False, **kwargs)
            except jinja2.TemplateError as exc:
                raise ArcherError(
                    f"the chat template failed on the prompt of row {i}: {exc}",
                    "fix actor_rollout_ref.model.custom_chat_template (or data.apply_chat_template_kwargs), "
                    "or the messages of that row",
                ) from exc

        texts = [render(i, template_kwargs) for i in range(len(rows))]
        if texts and template_kwargs.get("tools"):
            without = {k: v for k, v in template_kwargs.items() if k != "tools"}
            if render(0, without) == texts[0]:
                raise ArcherError(
                    "data.apply_chat_template_kwargs.tools is set, but the chat template renders the prompt the "
                    "same with and without it: the model would never see its tools",
                    "use a chat template that renders tools (Qwen2.5's and Qwen3's do; or set "
                    "actor_rollout_ref.model.custom_chat_template to one), or describe the tools in the prompt "
                    "and drop data.apply_chat_template_kwargs.tools",
                )
        return texts

    def _fit(self, ids: list[int], index: int, truncation: str, filter_overlong: bool) -> list[int] | None:
        """The ids to keep for one prompt, or None when it is filtered out."""
        if len(ids) <= self.max_prompt_length:
            return ids
        if filter_overlong:
            self.num_filtered += 1
            return None
        if truncation == "error":
            raise ArcherError(
                f"{self.where}the prompt of row {index} is {len(ids)} tokens, longer than "
                f"data.max_prompt_length={self.max_prompt_length} (the longest prompt has {self.longest_row})",
                self.overlong_fix.format(longest=self.longest_row),
            )
        self.num_truncated += 1
        return truncate_ids(ids, self.max_prompt_length, truncation)

    def _log(self, num_rows: int, truncation: str) -> None:
        logger.info(
            "RL dataset: %d of %d prompts kept (max_prompt_length=%d); %d filtered as overlong, "
            "%d truncated (%s)",
            len(self._items), num_rows, self.max_prompt_length, self.num_filtered, self.num_truncated, truncation,
        )


def _item(row: dict[str, Any], ids: list[int], index: int, prompt_key: str, reward_fn_key: str) -> dict[str, Any]:
    reward_model = row.get("reward_model") or {}
    item = {
        "prompt_ids": ids,
        "raw_prompt": row[prompt_key],
        "data_source": row["data_source"],
        "ability": row.get("ability") or "",
        "ground_truth": reward_model.get("ground_truth"),
        "extra_info": row.get("extra_info") or {},
        "tools": row.get("tools"),
        "index": index,
    }
    item.setdefault(reward_fn_key, row[reward_fn_key])
    return item
