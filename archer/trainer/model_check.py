"""Checks of an RL config against its model, run once the model's config.json and the prompts are read and
before any weights load: every sequence the run can make (its longest prompt plus ``data.max_response_length``
tokens, tool output included) fits the model's positions.
"""

from __future__ import annotations

from omegaconf import DictConfig

from archer.errors import ArcherError
from archer.models.loading import max_positions, read_model_config


def check_sequence_lengths(cfg: DictConfig, longest_prompt: int) -> None:
    """Refuse a run whose prompts of up to ``longest_prompt`` tokens plus a full response overrun the model."""
    model = cfg.actor_rollout_ref.model
    limit = max_positions(read_model_config(model.path, trust_remote_code=bool(model.trust_remote_code)))
    response = int(cfg.data.max_response_length)
    if limit is None or longest_prompt + response <= limit:
        return
    raise ArcherError(
        f"prompts of up to {longest_prompt} tokens (data.max_prompt_length={cfg.data.max_prompt_length}) plus "
        f"data.max_response_length={response} make sequences of {longest_prompt + response} tokens, beyond the "
        f"{limit} positions of the model {model.path} (its max_position_embeddings)",
        f"lower data.max_prompt_length (with data.filter_overlong_prompts=true, longer prompts are dropped) or "
        f"data.max_response_length so that the two add up to at most {limit}, or use a model with more positions")
