"""Mixture-of-Experts layers (Qwen3-MoE, OLMoE) in one set of kernels for the trainer and the fast engine.

A sparse block routes each token to ``top_k`` of ``E`` experts: softmax over the router's logits (float32),
top-k, renormalised to sum 1 where the config's ``norm_topk_prob`` says so, cast back to the logits' dtype
(``route``, Hugging Face's order of operations). The experts' SwiGLU MLPs are stored fused, as transformers 5
stores them: ``gate_up`` [E, 2I, H] and ``down`` [E, H, I]. ``grouped_experts`` sorts the N * k (token,
expert) pairs by expert and runs each projection as one grouped matmul over the sorted rows
(``torch.nn.functional.grouped_mm``, with the experts' row offsets computed on the device, so the host never
waits and a CUDA graph can hold it); where grouped_mm cannot run (no such function, or strides that are not
multiples of 16 bytes), the sorted rows are laid into an [E, capacity, H] batch and multiplied by ``bmm``
(capacity read back from the device: eager only). Neither is a Python loop over experts or tokens.

``use_grouped_experts`` points a transformers model's expert modules (any module holding 3-D ``gate_up_proj`` /
``down_proj`` parameters) at ``grouped_experts`` in place of transformers' per-expert loop, so the trainer's
update and no-grad passes run the engine's kernel; autograd goes through grouped_mm (or bmm) as through any op.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from archer.errors import ArcherError

_ALIGN = 16  # bytes: grouped_mm's stride alignment
_SILU = ("SiLU", "SiLUActivation")  # torch's and transformers' SiLU modules


def route(logits: torch.Tensor, top_k: int, normalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [N, k] in the logits' dtype, expert ids [N, k]) of router ``logits`` [N, E]."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def _grouped_mm_runs(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether grouped_mm takes rows ``x`` [S, K] against ``w`` [E, K, M] (a transposed view is fine)."""
    item = x.element_size()
    return (hasattr(F, "grouped_mm") and x.shape[1] * item % _ALIGN == 0 and w.shape[1] * item % _ALIGN == 0
            and w.shape[2] * item % _ALIGN == 0)


def _grouped(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows ``x`` [S, K] sorted by expert (expert e's rows end at ``offsets[e]``) times w[e] [K, M]: [S, M]."""
    if _grouped_mm_runs(x, w):
        return F.grouped_mm(x, w, offs=offsets)
    experts = w.shape[0]
    capacity = max(int(counts.max()), 1)
    starts = offsets - counts
    expert = torch.repeat_interleave(torch.arange(experts, device=x.device), counts, output_size=x.shape[0])
    slot = torch.arange(x.shape[0], device=x.device) - starts[expert]
    padded = x.new_zeros(experts, capacity, x.shape[1]).index_put((expert, slot), x)
    return torch.bmm(padded, w)[expert, slot]


def grouped_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor) -> torch.Tensor:
    """sum_j weights[n, j] * down[e] @ (silu(gate[e] @ x[n]) * up[e] @ x[n]), e = ids[n, j]: the sparse block's
    output [N, H] for tokens ``x`` [N, H] (``gate_up`` [E, 2I, H], ``down`` [E, H, I])."""
    tokens, top_k = ids.shape
    experts = gate_up.shape[0]
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else gate_up.dtype
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(experts, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offsets = counts.cumsum(0).to(torch.int32)
    rows = x.to(dtype).index_select(0, order // top_k)
    gate, up = _grouped(rows, gate_up.to(dtype).transpose(1, 2), offsets, counts).chunk(2, dim=-1)
    out_sorted = _grouped((F.silu(gate) * up).contiguous(), down.to(dtype).transpose(1, 2), offsets, counts)
    out = torch.empty_like(out_sorted).index_copy_(0, order, out_sorted).view(tokens, top_k, -1)
    return (out * weights.to(out.dtype).unsqueeze(-1)).sum(dim=1).to(x.dtype)


def _experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    return grouped_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)


def is_fused_experts(module: nn.Module) -> bool:
    """A transformers expert module with fused 3-D weights (gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3
            and down.dim() == 3)


def use_grouped_experts(model: nn.Module) -> int:
    """Run every SiLU fused-expert module of ``model`` through ``grouped_experts``; returns how many."""
    count = 0
    for module in model.modules():
        if is_fused_experts(module) and type(getattr(module, "act_fn", None)).__name__ in _SILU:
            module.forward = types.MethodType(_experts_forward, module)
            count += 1
    return count


def token_intermediate(config) -> int:
    """The MLP width one token's activations span (the memory plan's ``intermediate``): a dense model's
    ``intermediate_size``; an MoE's ``num_experts_per_tok`` experts of ``moe_intermediate_size`` (Qwen3-MoE) or
    ``intermediate_size`` (OLMoE) each, or Qwen3-MoE's dense ``intermediate_size`` where that is wider (a bound:
    its config carries one whether or not a layer is dense)."""
    dense = int(config.intermediate_size)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not top_k:
        return dense
    expert = getattr(config, "moe_intermediate_size", None)
    return max(int(top_k) * int(expert or dense), dense if expert else 0)


def refuse_router_loss(config, path: str) -> None:
    """An ArcherError for a model whose config asks for the router's auxiliary loss (``output_router_logits`` with
    a non-zero ``router_aux_loss_coef``): the policy update does not add it, and says so rather than train
    without it."""
    if getattr(config, "output_router_logits", False) and float(getattr(config, "router_aux_loss_coef", 0) or 0):
        raise ArcherError(
            f"the model {path} asks for the router's auxiliary loss (output_router_logits=true, "
            f"router_aux_loss_coef={config.router_aux_loss_coef}), which archer's policy update does not add",
            "set output_router_logits to false in the model's config.json (RL updates usually leave the router's "
            "balance loss off), or train it with another framework")
