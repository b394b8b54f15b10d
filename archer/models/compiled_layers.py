"""torch.compile of a policy's decoder layers (verl's ``actor.use_torch_compile`` and ``ref.use_torch_compile``).

On the RL recipes' micro-batches the update and the log-prob passes are launch-bound: an eager Qwen2.5-1.5B
decoder layer is dozens of small kernels (norms, rotary, SwiGLU, casts), and the host cannot launch them as fast
as the GPU runs them. With the key on (verl's default, ``true``) archer compiles each decoder layer's forward with
torch.compile (inductor fuses the elementwise ops; the matrix products and attention stay cuBLAS and flash):
BENCHMARKS.md, "The decoder layers compiled by default", has the measured update and log-prob times.

What to know:
- GPU only: on the CPU the key has no effect (no message: the passes compute the same numbers either way). The
  layers' results agree with the eager ones to float rounding (fused elementwise ops), not bit for bit
  (tests/test_compiled_layers.py);
- one compiled graph serves every layer and every micro-batch size (``dynamic=True``, a layer's ``forward``
  compiled, not its ``__call__``, so FSDP2's hooks stay eager around it); a checkpointed layer's recompute is part
  of its compiled backward (transformers >= 5.23 checkpoints a layer's ``forward``; with an older release archer
  gives the layer a subclass that does the same, ``checkpointing_forward``); the first update and log-prob passes
  pay the compile, one graph per kind of pass (train / eval, packed / padded, each model's dtype, checkpointed or
  not when ``model.gradient_checkpointing_layers`` checkpoints only some layers): about 80 s of
  the Archer2.0 recipe's first step at 1.5B, so short runs may rather set the key to false;
- with ``model.use_liger=true`` the layers keep liger's kernels, uncompiled (torch.compile cannot trace liger's
  autograd functions; one warning);
- the layers run eagerly where their inputs are of another kind: generation with a KV cache (the hf engine,
  rollout/hf_engine.py) and the influence trace's hooked passes (``eager_layers``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._inductor import config as inductor_config
from torch.distributed.fsdp import FSDPModule
from transformers.modeling_layers import GradientCheckpointingLayer

from archer.distributed.fsdp import decoder_layers

log = logging.getLogger("archer.models")

ACTOR_KEY = "actor_rollout_ref.actor.use_torch_compile"
REF_KEY = "actor_rollout_ref.ref.use_torch_compile"
RECOMPILE_LIMIT = 16  # graphs of one layer class (torch's default, 8, would leave later kinds of pass eager)


def _inductor_options() -> dict[str, Any]:
    """inductor's options for the layers: no fusion decision that depends on the token count. Its mix-order
    reductions (torch 2.10+) are chosen by size thresholds that become guards of the graph, and the micro-batches
    that cross them were compiled again (eight times on the recipe's packed micro-batches, 2026-11-28)."""
    return {"triton.mix_order_reduction": False} if hasattr(inductor_config.triton, "mix_order_reduction") else {}


def checkpointing_forward(cls: type[nn.Module]) -> type[nn.Module]:
    """A decoder-layer class whose ``forward`` does the layer's gradient checkpointing: ``cls`` itself where
    transformers checkpoints ``forward`` (>= 5.23), else a subclass of the same name that checkpoints its forward
    and calls it as torch does (older releases checkpoint in ``GradientCheckpointingLayer.__call__``). Compiled,
    the recompute is then part of the layer's compiled backward instead of a second call of its compiled forward,
    with its own guards and launches (the Archer2.0 recipe's update at 8-row micro-batches, transformers 5.17:
    2.98 s a PPO epoch the old way, 2.17 s this way; BENCHMARKS.md, "Checkpointed layers compiled whole")."""
    if cls.__call__ is nn.Module.__call__ or cls.__call__ is not GradientCheckpointingLayer.__call__:
        return cls  # transformers >= 5.23, or a layer's own __call__ (remote code), which stays as it is
    forward = cls.forward

    def forward_with_checkpointing(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return self._gradient_checkpointing_func(functools.partial(forward, self, **kwargs), *args)
        return forward(self, *args, **kwargs)

    namespace = {"__call__": nn.Module.__call__, "forward": forward_with_checkpointing, "__module__": cls.__module__,
                 "__qualname__": cls.__qualname__}
    if issubclass(cls, FSDPModule):  # FSDP2's class finds the model's own one by its place in the MRO: one further
        namespace["_orig_cls_mro_index"] = getattr(cls, "_orig_cls_mro_index", 2) + 1
    return type(cls.__name__, (cls,), namespace)


def compile_decoder_layers(model: nn.Module) -> int:
    """Compile the forward of each of ``model``'s decoder layers in place (shapes dynamic; checkpointing inside it,
    ``checkpointing_forward``); returns how many. Each layer gets its class's compiled forward bound to it (so a deep
    copy of the model runs its own layers)."""
    layers = decoder_layers(model)
    # the kinds of pass (train / eval, packed / padded, each model's dtype) each take a graph of the shared code
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    compiled: dict[type, tuple[type[nn.Module], Callable[..., Any]]] = {}
    for layer in layers:
        cls = type(layer)
        if cls not in compiled:
            own = checkpointing_forward(cls)
            compiled[cls] = own, torch.compile(own.forward, dynamic=True, options=_inductor_options())
        layer.__class__, forward = compiled[cls]
        layer.forward = types.MethodType(forward, layer)
    return len(layers)


def maybe_compile_layers(model: nn.Module, device: torch.device, *, enabled: bool, liger: bool, key: str,
                         announce: bool = True) -> bool:
    """Compile ``model``'s decoder layers when ``enabled`` (the config ``key``) on a GPU, unless liger's kernels
    run in them (``liger``: warned when ``announce``); returns whether it did."""
    if not enabled or device.type != "cuda":
        return False
    if liger:
        if announce:
            log.warning("%s=true leaves the decoder layers uncompiled: model.use_liger=true runs liger's kernels "
                        "in them, which torch.compile cannot trace (set model.use_liger=false to compile them)", key)
        return False
    count = compile_decoder_layers(model)
    if announce:
        log.info("%s: %d decoder layers compiled (the first update and log-prob passes include the compile)",
                 key, count)
    return True


@contextlib.contextmanager
def eager_layers() -> Iterator[None]:
    """Run compiled layers (and anything else compiled) eagerly inside the block."""
    with torch.compiler.set_stance("force_eager"):
        yield
