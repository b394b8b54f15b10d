"""FSDP2 for archer's models: sharding a model over the ranks of a ``DistContext``, loading it from rank 0's
weights, gathering whole tensors out of the shards, and gradient clipping by the global norm.

Sharding (``shard_model``) follows verl's ``apply_fsdp2``: ``fully_shard`` on every decoder layer (the classes
in ``model._no_split_modules``; with LoRA the adapters live inside those layers and are sharded with them),
then on the root, with an explicit mesh, a mixed-precision policy (bf16 compute over fp32 master weights on a
GPU, reductions in fp32) and optional CPU offload. Gradients are SUMMED over ranks, not averaged: each rank
normalises its loss by the whole (global) mini-batch's totals, so the summed gradient is the single-process
one up to float reduction order.

Loading: rank 0 reads the HF folder into host memory and the other ranks build the model on the meta device;
``shard_model`` then shards the architecture and ``load_from_rank0`` allocates each rank's shards and
broadcasts rank 0's weights into them (verl's ``fsdp2_load_full_state_dict``): one full copy in host memory,
on rank 0, not one per rank. A LoRA base is read by every rank (peft makes the adapters on each).

The whole weights of a model (what the rollout engines and the HF export take) are
``archer.models.lora.policy_weights``, which gathers them one at a time with ``reshard``, ``full_tensor`` and
``whole_parameters`` from here: one stream, one LoRA merge, sharded or not.

Every function here is a collective when the model is sharded: all ranks must call it, in the same order
(each ``full_tensor()`` is an all-gather). At world 1 (no mesh) the same functions work on the plain model,
so a worker calls them unconditionally.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from peft import PeftModel
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from archer.distributed.context import DistContext
from archer.errors import ArcherError


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (with its LoRA layers injected), else ``model``: the
    module whose parameter names are the plain HF model's and that workers run forward on."""
    return model.get_base_model() if isinstance(model, PeftModel) else model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The modules ``shard_model`` shards one by one: those whose class is named in the transformers model's
    ``_no_split_modules`` (the decoder layers; once sharded, FSDP2's subclasses of them), in module order; an
    ArcherError when there are none."""
    root = unwrap(model)
    names = set(getattr(root, "_no_split_modules", None) or ())
    layers = [module for module in root.modules() if any(cls.__name__ in names for cls in type(module).__mro__)]
    if not layers:
        raise ArcherError(f"{type(root).__name__} declares no decoder-layer classes (_no_split_modules="
                          f"{sorted(names)!r} matches no module), so FSDP2 cannot shard it layer by layer",
                          "use a transformers causal LM / token-classification model (Qwen2, Llama, ...) or run "
                          "on one device (trainer.n_gpus_per_node=1)")
    return layers


def shard_model(model: nn.Module, ctx: DistContext, *, param_dtype: torch.dtype,
                reduce_dtype: torch.dtype = torch.float32, cpu_offload: bool = False,
                reshard_after_forward: bool = True) -> nn.Module:
    """Shard ``model`` in place over ``ctx.mesh`` and return it (a peft model is sharded through its
    transformers model, so calling either runs the hooks). Without a mesh (world 1) the model is returned
    as it is.

    ``param_dtype``: the dtype layers compute in (bfloat16 on GPUs; the sharded master weights keep their own
    dtype, float32 for a trained model); ``reduce_dtype``: the gradient reduction's; ``cpu_offload``: keep the
    shards, gradients and optimizer state on the CPU (verl's ``fsdp_config.offload_policy``), pinned on GPUs;
    ``reshard_after_forward``: free the gathered weights after each layer's forward (ZeRO-3; False keeps them
    until backward, faster for many forwards such as log-prob passes).

    Gradients are summed over ranks (divide factor 1): normalise the loss by the global mini-batch."""
    if ctx.mesh is None:
        return model
    root = unwrap(model)
    mixed = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda") if cpu_offload else OffloadPolicy()
    for layer in reversed(decoder_layers(root)):  # inner before outer, should layer classes ever nest
        fully_shard(layer, mesh=ctx.mesh, mp_policy=mixed, offload_policy=offload,
                    reshard_after_forward=reshard_after_forward)
    # The root (embedding, final norm, LM head) stays gathered after its forward: archer's chunked log-prob
    # reads the LM head after the forward returns (models/logprobs.py), and the backward needs it right away.
    fully_shard(root, mesh=ctx.mesh, mp_policy=mixed, offload_policy=offload, reshard_after_forward=False)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # no averaging: the loss carries the global normaliser
            module.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)
    return model


def load_from_rank0(model: nn.Module, state: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                    ctx: DistContext, *, cpu_offload: bool = False) -> None:
    """Fill a model just sharded by ``shard_model`` from rank 0's whole weights: ``state`` (its state dict) and
    ``buffers`` (every buffer, the non-persistent rotary tables included) on rank 0, empty on the other ranks,
    whose model was built on the meta device. Each rank allocates its shards (on its device, or in host memory
    with ``cpu_offload``) and receives them by broadcast. All ranks call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    root = unwrap(model)
    root.to_empty(device="cpu" if cpu_offload else ctx.device)
    for module in root.modules():  # buffers are computed with on the device, offloaded shards or not
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(ctx.device)
    set_model_state_dict(root, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for name, buffer in root.named_buffers():
        if ctx.is_main:
            buffer.copy_(buffers[name].to(buffer.device))
        if ctx.distributed:
            moved = buffer.to(ctx.device)
            torch.distributed.broadcast(moved, src=0)
            buffer.copy_(moved)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor's shards all-gathered (on the mesh's device when they were offloaded), a
    plain tensor as it is (no copy)."""
    if not isinstance(tensor, DTensor):
        return tensor
    mesh_device = tensor.device_mesh.device_type
    if tensor.device.type != mesh_device:
        tensor = tensor.to(mesh_device)
    return tensor.full_tensor()


def reshard(model: nn.Module) -> None:
    """Every FSDP unit of ``model`` back to its sharded state (a forward with ``reshard_after_forward=False``
    leaves the root gathered), so that each rank sees the same DTensor parameters; nothing unsharded."""
    for module in unwrap(model).modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@contextlib.contextmanager
def whole_parameters(*modules: nn.Module) -> Iterator[None]:
    """Inside the block, the sharded (DTensor) parameters held directly by ``modules`` are their whole tensors
    (gathered, detached), for code that reads a module's weights itself (peft's ``get_delta_weight``); the
    shards are put back after. Unsharded parameters are left as they are. Not for a forward or backward."""
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    try:
        for module in modules:
            for name, param in list(module._parameters.items()):
                if isinstance(param, DTensor):
                    swapped.append((module, name, param))
                    module._parameters[name] = nn.Parameter(full_tensor(param.detach()), requires_grad=False)
        yield
    finally:
        for module, name, param in swapped:
            module._parameters[name] = param


def clip_grad_norm(model: nn.Module, max_norm: float | None) -> float:
    """Scale the gradients so that their global L2 norm is at most ``max_norm`` and return that norm (over
    every rank's shards, so the same float on all ranks; 0.0 without gradients). ``max_norm`` None or <= 0
    clips nothing (``archer.models.optim.clip_and_step``'s contract). A non-finite norm leaves the
    gradients as they are and is returned as is: the caller skips the optimizer step and zeroes them."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    grads = [p.grad for p in params]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(total, DTensor):
        total = full_tensor(total)
    norm = float(total)
    if math.isfinite(norm) and max_norm is not None and max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, float(max_norm), total.to(grads[0].device))
    return norm
