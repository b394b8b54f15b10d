"""Which of the policy's decoder layers recompute their activations in the backward (archer's
``actor_rollout_ref.model.gradient_checkpointing_layers``, beside verl's ``enable_gradient_checkpointing``).

verl checkpoints every decoder layer when ``enable_gradient_checkpointing=true``: each layer keeps only its input
and runs its forward again in the backward, about a third more compute for the update. Recipes turn it on to be
safe, also where the card would hold the activations of many layers. With ``auto`` (the default) archer
checkpoints only as many layers as the memory plan needs (workers/memory.py: the fewest whose update still fits the
card with a margin; on the CPU, where there is no plan, every layer); ``all`` is verl's behaviour; a number
checkpoints the first that many layers. The losses and gradients are the same either way (a checkpointed layer
recomputes exactly its forward): only the update's memory and time change. Without
``enable_gradient_checkpointing`` no layer is checkpointed and the key has no effect.
"""

from __future__ import annotations

from omegaconf import DictConfig
from torch import nn

from archer.distributed.fsdp import decoder_layers
from archer.errors import ArcherError

KEY = "actor_rollout_ref.model.gradient_checkpointing_layers"


def requested_checkpointed_layers(model_cfg: DictConfig, layers: int) -> int | None:
    """How many of ``layers`` decoder layers the config checkpoints: 0 without enable_gradient_checkpointing, None
    for ``auto`` (the memory plan chooses), ``layers`` for ``all``, else the number given (0 to ``layers``)."""
    value = model_cfg.get("gradient_checkpointing_layers", "auto")
    enabled = bool(model_cfg.enable_gradient_checkpointing)
    if value in ("auto", "all"):
        return None if enabled and value == "auto" else (layers if enabled else 0)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= layers:
        raise ArcherError(f"{KEY}={value!r} is not auto, all or a number of decoder layers from 0 to {layers}",
                          f"set {KEY}=auto (the memory plan chooses), all (every layer, verl's) or a number")
    if not enabled and value:
        raise ArcherError(f"{KEY}={value} asks for checkpointed layers but "
                          "actor_rollout_ref.model.enable_gradient_checkpointing=false turns checkpointing off",
                          f"set actor_rollout_ref.model.enable_gradient_checkpointing=true, or leave {KEY} at auto")
    return value


def checkpoint_first_layers(model: nn.Module, count: int) -> int:
    """Checkpoint the first ``count`` decoder layers of ``model`` and let the others keep their activations
    (transformers' per-layer ``gradient_checkpointing`` flag; checkpointing must have been enabled on the model,
    ``set_gradient_checkpointing``). Returns how many layers the model has."""
    layers = decoder_layers(model)
    for index, layer in enumerate(layers):
        if not hasattr(layer, "gradient_checkpointing"):
            raise ArcherError(f"{type(layer).__name__} has no per-layer gradient_checkpointing flag, so {KEY} "
                              "cannot checkpoint some of its layers and not others",
                              f"set {KEY}=all")
        layer.gradient_checkpointing = index < count
    return len(layers)
