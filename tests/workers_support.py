"""Helpers shared by the worker tests: the config they take, a hand-built batch and float64 reference numbers."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from omegaconf import DictConfig

from archer.batch import Batch
from archer.config.loader import load_config
from archer.models.compiled_layers import compile_decoder_layers
from archer.workers import actor as actor_module

PAD = 0
# Three rows: left-padded prompts of width 4, right-padded responses of width 3.
PROMPT_IDS = [[PAD, PAD, 11, 12], [13, 14, 15, 16], [PAD, 17, 18, 19]]
PROMPT_MASK = [[0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]]
RESPONSE_IDS = [[21, 22, PAD], [23, 24, 25], [26, PAD, PAD]]
RESPONSE_MASK = [[1, 1, 0], [1, 1, 1], [1, 0, 0]]
# cumsum(attention_mask) - 1, clamped at 0, written out by hand
POSITION_IDS = [[0, 0, 0, 1, 2, 3, 3], [0, 1, 2, 3, 4, 5, 6], [0, 0, 1, 2, 3, 3, 3]]


def ppo_config(model_dir: Path, *overrides: str) -> DictConfig:
    """The whole ppo_trainer config for the micro model; pass ``.actor_rollout_ref`` or ``.critic`` to a worker."""
    return load_config("ppo_trainer", [f"actor_rollout_ref.model.path={model_dir}", "data.train_files=x", *overrides])


def hand_batch() -> Batch:
    """The three-row prompt + response batch above, with the fields the workers read."""
    response_mask = torch.tensor(RESPONSE_MASK)
    return Batch({
        "input_ids": torch.cat([torch.tensor(PROMPT_IDS), torch.tensor(RESPONSE_IDS)], dim=1),
        "attention_mask": torch.cat([torch.tensor(PROMPT_MASK), response_mask], dim=1),
        "position_ids": torch.tensor(POSITION_IDS),
        "responses": torch.tensor(RESPONSE_IDS),
        "response_mask": response_mask,
    })


# Six rows of unequal lengths: prompts (width 6) and responses (width 5); sequences of 6, 7, 6, 6, 6 and 10 tokens.
UNEQUAL_PROMPTS, UNEQUAL_RESPONSES = [1, 6, 3, 4, 2, 5], [5, 1, 3, 2, 4, 5]


def unequal_batch(vocab_size: int) -> Batch:
    """The six rows above with random tokens; row 5's third response token is tool output (attention 1,
    response_mask 0)."""
    gen = torch.Generator().manual_seed(3)
    columns = torch.arange(11)
    attention = torch.stack([(columns >= 6 - p) & (columns < 6 + r)
                             for p, r in zip(UNEQUAL_PROMPTS, UNEQUAL_RESPONSES, strict=True)]).long()
    input_ids = torch.randint(3, vocab_size, (6, 11), generator=gen) * attention
    response_mask = attention[:, 6:].clone()
    response_mask[5, 2] = 0
    return Batch({"input_ids": input_ids, "attention_mask": attention,
                  "position_ids": (attention.cumsum(1) - 1).clamp(min=0), "responses": input_ids[:, 6:],
                  "response_mask": response_mask})


def float64_logprobs(model: torch.nn.Module, batch: Batch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of the responses from a plain full-logits forward of a float64 copy of ``model``."""
    reference = copy.deepcopy(model).double().eval()
    response_length = batch["responses"].shape[1]
    with torch.no_grad():
        logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           position_ids=batch["position_ids"]).logits
    log_softmax = torch.log_softmax(logits[:, -response_length - 1:-1] / temperature, dim=-1)
    logp = log_softmax.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    valid = batch["response_mask"].bool()
    return torch.where(valid, logp, 0.0), torch.where(valid, entropy, 0.0)


def update(actor, batch: Batch) -> dict[str, float]:
    """The metrics of one ``update_actor`` call."""
    return actor.update_actor(batch).metrics


def compile_layers_as_on_a_gpu(monkeypatch) -> None:
    """ActorWorkers built from now on compile their decoder layers as actor.use_torch_compile does on a GPU, here
    on the CPU (inductor's CPU kernels: a C++ compiler)."""
    monkeypatch.setattr(actor_module, "maybe_compile_layers",
                        lambda model, *_args, **_kwargs: compile_decoder_layers(model) > 0)
