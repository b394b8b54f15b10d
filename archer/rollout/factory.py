"""Which generation engine `actor_rollout_ref.rollout.name` builds on the actor's model.

- ``fast``: archer's own engine (archer/rollout/fast/); an architecture it cannot run is an error naming ``hf``;
- ``hf``: the Hugging Face decoding loop (archer/rollout/hf_engine.py), for every architecture and the CPU;
- ``auto`` (the default): ``fast`` on a GPU for the architectures it runs, else ``hf`` (a warning says why, each
  time the choice is made);
- verl's ``vllm`` / ``sglang``: as ``auto``, with a note that archer generates with its own engines.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from omegaconf import DictConfig
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from archer.errors import ArcherError
from archer.rollout.base import RolloutEngine
from archer.rollout.fast.engine import FastEngine
from archer.rollout.fast.model import check_device_support, model_spec
from archer.rollout.hf_engine import HFGenerateEngine

log = logging.getLogger("archer.rollout")

ENGINE_NAMES = ("auto", "fast", "hf")
VERL_ENGINE_NAMES = ("vllm", "sglang")  # verl's engines: archer's own stand in for them, as with auto


def check_engine_name(name: str) -> None:
    """Refuse an engine archer does not have (before any model loads); note what verl's names mean here."""
    if name in VERL_ENGINE_NAMES:
        log.info("rollout.name=%s: archer generates with its own engines (as rollout.name=auto: fast on a GPU, "
                 "hf otherwise); the %s-specific rollout keys are accepted and ignored", name, name)
    elif name not in ENGINE_NAMES:
        raise ArcherError(f"unknown rollout engine {name!r}",
                          f"set actor_rollout_ref.rollout.name to one of: {', '.join(ENGINE_NAMES)}")


def build_engine(rollout: DictConfig, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 device: torch.device, *, standalone: bool = False,
                 weights: Iterable[tuple[str, torch.Tensor]] | None = None, record_routes: bool = False
                 ) -> RolloutEngine:
    """The engine ``rollout.name`` names (checked by ``check_engine_name``), generating from ``model``'s weights.
    The fast engine always holds its own copy; the hf engine runs ``model`` itself unless ``standalone`` (its own
    module in rollout.dtype on a GPU, float32 on a CPU, filled by sync_weights: for a sharded policy).
    ``weights``: the fast engine's first weights (default: ``model``'s own; a sharded policy gives its stream);
    ``record_routes``: the fast engine records each token's experts (routing replay)."""
    if uses_fast_engine(rollout, model, device):
        return FastEngine.from_config(model, tokenizer, rollout, device=device, weights=weights,
                                      record_routes=record_routes)
    if standalone:
        dtype = getattr(torch, str(rollout.dtype)) if device.type == "cuda" else torch.float32
        return HFGenerateEngine.standalone(model, tokenizer, device=device, dtype=dtype,
                                           max_batch_size=int(rollout.max_batch_size))
    return HFGenerateEngine(model, tokenizer, device=device, max_batch_size=int(rollout.max_batch_size))


def uses_fast_engine(rollout: DictConfig, model: PreTrainedModel, device: torch.device) -> bool:
    """Whether ``build_engine`` builds the fast engine for ``model`` on ``device``."""
    return rollout.name == "fast" or (rollout.name != "hf" and _fast_engine_runs(model, device))


def _fast_engine_runs(model: PreTrainedModel, device: torch.device) -> bool:
    """Whether auto picks the fast engine: on a GPU, for an architecture (and head size) it runs there."""
    if device.type != "cuda":
        return False
    try:
        check_device_support(model_spec(model), device)
    except ArcherError as e:
        log.warning("rollout.name=auto: generating with the hf engine, because %s", e.problem)
        return False
    return True
