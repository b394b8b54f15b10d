"""The RL trainer's data, built from its ``data`` config: tokenizer, train and validation sets, prompt loader.

The tokenizer, the datasets and the loader are built here, from ``tokenizer``, ``train_files``, ``val_files``,
``prompt_key``, ``reward_fn_key``, ``require_ground_truth``, ``max_prompt_length``, ``truncation``,
``filter_overlong_prompts``, ``apply_chat_template_kwargs``, ``train_batch_size`` / ``gen_batch_size`` (prompts
per loader batch), ``shuffle`` and ``seed``. The trainer (archer.trainer.ppo) reads ``data.*`` keys for its
own jobs too: ``train_batch_size`` (the prompts dynamic sampling collects), ``val_batch_size`` (prompts per
validation batch), ``reward_fn_key`` (the reward manager's routing), ``max_response_length`` (the overlong
buffer, the clip-ratio metric) and the file lists (the run summary); it hands ``apply_chat_template_kwargs`` to
the ActorWorker, whose rollout renders the tool messages of multi_turn.format=hermes with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf
from transformers import PreTrainedTokenizerBase

from archer.config.loader import as_list
from archer.data.loader import PromptLoader
from archer.data.parquet import read_rl_files
from archer.data.rl_dataset import RLDataset
from archer.models.loading import load_tokenizer


@dataclass
class RLData:
    tokenizer: PreTrainedTokenizerBase
    train: RLDataset | None  # None when data.train_files is not set (trainer.val_only)
    val: RLDataset | None  # None when data.val_files is not set
    loader: PromptLoader | None  # batches of train prompts (None without them)


def build_rl_data(data: DictConfig, *, model_path: Any, chat_template: str | None) -> RLData:
    """The tokenizer (``data.tokenizer``, else the model's), the datasets of the files given and the train prompt
    loader."""
    tokenizer = load_tokenizer(data.tokenizer) if data.tokenizer else load_tokenizer(model_path, role="model")

    def dataset(files: list) -> RLDataset:
        rows = read_rl_files(files, prompt_key=data.prompt_key, reward_fn_key=data.reward_fn_key,
                             require_ground_truth=bool(data.require_ground_truth))
        return RLDataset(rows, tokenizer, max_prompt_length=int(data.max_prompt_length), truncation=data.truncation,
                         filter_overlong_prompts=bool(data.filter_overlong_prompts), prompt_key=data.prompt_key,
                         reward_fn_key=data.reward_fn_key, chat_template=chat_template,
                         apply_chat_template_kwargs=OmegaConf.to_container(data.apply_chat_template_kwargs))

    train_files, val_files = as_list(data.train_files), as_list(data.val_files)
    train = dataset(train_files) if train_files else None
    val = dataset(val_files) if val_files else None
    loader = None if train is None else PromptLoader(train, int(data.gen_batch_size or data.train_batch_size),
                                                     shuffle=bool(data.shuffle), seed=int(data.seed))
    return RLData(tokenizer, train, val, loader)
