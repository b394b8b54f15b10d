"""Routing replay of a Mixture-of-Experts policy (verl's ``actor_rollout_ref.actor.router_replay.mode``).

The rollout engine and the trainer compute each token's top-k experts independently; float differences between
their kernels flip near-tied choices, and a flipped expert changes the token's log-prob far more than the
rounding that flipped it. Routing replay makes the trainer's passes route each token to the experts the engine
recorded for it (R3, "rollout routing replay"), so that the old log-probs and the update score the tokens through
the experts that sampled them. Only the selection is replayed: the gate weights are the trainer's own softmax of
its router logits, gathered at the replayed experts (and renormalised where the model's ``norm_topk_prob`` says
so), so the router's weights still get gradients. R2 ("vanilla routing replay") records the trainer's own routing in
the old-log-prob pass instead, and the update replays it, so that every epoch and mini-batch of the update routes
as the policy before it did.

What this module owns:

- ``ReplaySettings``: the keys (``router_replay.mode``: ``disabled`` | ``R3`` | ``R2``: the old-log-prob pass
  records its own routers' top-k, ``own_routes``, and the update replays them; ``rollout.enable_rollout_routing_replay``,
  implied by R3: the engine records, and the old-log-prob pass measures the mismatch without replaying);
- the batch field ``routed_experts``: int16 [B, P + R, MoE layers, top_k] aligned with ``input_ids`` (the fast
  engine's records laid out by ``sequence_routes``, or R2's; -1 where nothing was recorded: padding and each response's
  last token, which the engine never fed; such tokens route by the trainer's own top-k);
- ``layout_routes``: the records of a micro-batch in the order the model's MoE blocks see its tokens (the
  micro-batch's ``SequenceLayout``, padded, left-aligned or packed);
- ``replaying``: the context in which every MoE block's router of a transformers model takes those experts
  (a forward hook on each sparse block's ``gate``), and counts per row how often its own top-k differs from
  them (``RouteCounts``; ``mismatch_metrics``: ``actor/router_mismatch_tokens``, the share of (token, MoE layer)
  routings whose top-k set differs, and ``actor/router_mismatch_choices``, the share of the k choices that do).

A replayed pass runs its decoder layers eagerly (``eager_layers``: the hooks stay outside a compiled graph).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from omegaconf import DictConfig
from torch import nn

from archer.batch import Batch, to_device
from archer.errors import ArcherError
from archer.models.compiled_layers import eager_layers
from archer.models.moe import is_fused_experts
from archer.models.sequence_layout import SequenceLayout

ROUTED_EXPERTS = "routed_experts"  # the batch field of the engine's records
ROUTE_COUNTS = (
    "router_route_counts"  # per row: recorded routings and choices, and those that differ (RouteCounts)
)
MODES = ("disabled", "R2", "R3")
MODE_KEY = "actor_rollout_ref.actor.router_replay.mode"
RECORD_KEY = "actor_rollout_ref.rollout.enable_rollout_routing_replay"
NOT_RECORDED = -1


@dataclass(frozen=True)
class ReplaySettings:
    """``record``: the engine records each token's experts (the rollout key, or R3); ``own``: the actor's
    old-log-prob pass records its own routers' top-k instead (R2); ``replay``: the passes route with the records
    the batch holds (R3: the old-log-prob pass and the update; R2: the update)."""

    record: bool = False
    replay: bool = False
    own: bool = False

    @classmethod
    def from_config(cls, actor_rollout_ref: DictConfig) -> ReplaySettings:
        mode = str(actor_rollout_ref.actor.router_replay.mode)
        if mode not in MODES:
            raise ArcherError(f"unknown {MODE_KEY}={mode!r}", f"use one of: {', '.join(MODES)}")
        record = bool(actor_rollout_ref.rollout.enable_rollout_routing_replay)
        if mode == "R2" and record:
            raise ArcherError(
                f"{MODE_KEY}=R2 replays the routing the old-log-prob pass records, so the engine's records of "
                f"{RECORD_KEY}=true would go unused",
                f"use {MODE_KEY}=R3 to replay the engine's routing, or set {RECORD_KEY}=false",
            )
        return cls(record=record or mode == "R3", replay=mode != "disabled", own=mode == "R2")


def sparse_gates(model: nn.Module) -> list[nn.Module]:
    """The router (``mlp.gate``) of every decoder layer whose MLP is a fused-expert sparse block, in layer order."""
    gates = []
    for module in model.modules():
        experts = getattr(module, "experts", None)
        while experts is not None and hasattr(experts, "get_base_layer"):  # peft's wrapper
            experts = experts.get_base_layer()
        if isinstance(experts, nn.Module) and is_fused_experts(experts) and hasattr(module, "gate"):
            gates.append(module.gate)
    return gates


def router_of(gate: nn.Module) -> nn.Module:
    """The router module under peft's wrappers (its ``top_k`` and ``norm_topk_prob``)."""
    while hasattr(gate, "get_base_layer"):
        gate = gate.get_base_layer()
    return gate


def sequence_routes(
    per_row: list[torch.Tensor], prompt_lengths: list[int], prompt_width: int, response_width: int
) -> torch.Tensor:
    """Per-row records (int16 [P_i + R_i - 1, layers, k], prompt then response) as ``routed_experts`` [B, P + R,
    layers, k], aligned with left-padded prompts of ``prompt_width`` and right-padded responses; -1 elsewhere."""
    layers, top_k = per_row[0].shape[1:] if per_row else (0, 0)
    out = torch.full(
        (len(per_row), prompt_width + response_width, layers, top_k), NOT_RECORDED, dtype=torch.int16
    )
    for row, (ids, length) in enumerate(zip(per_row, prompt_lengths, strict=True)):
        out[row, prompt_width - length : prompt_width] = ids[:length]
        response = ids[length : length + response_width]
        out[row, prompt_width : prompt_width + len(response)] = response
    return out


def pad_routes(routes: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """``routed_experts`` with ``left`` more prompt columns (before) and ``right`` more response columns (after)."""
    return torch.nn.functional.pad(routes, (0, 0, 0, 0, left, right), value=NOT_RECORDED)


def layout_sources(layout_of, rows: Batch) -> torch.Tensor:
    """[T] the flat position in ``rows``' [B, W] grid of each token of the micro-batch's layout, in the order the
    tokens enter the model (-1 for layout padding). ``layout_of``: how the pass lays a micro-batch out
    (``MicroBatching.layout``), applied to the rows with their token ids replaced by their flat positions (+1, so
    that a layout's padding, id 0, reads -1)."""
    batch, width = rows["attention_mask"].shape
    carrier = Batch(
        {
            **rows.select(["attention_mask", "position_ids", "responses"]).tensors,
            "input_ids": torch.arange(1, batch * width + 1).view(batch, width),
        }
    )
    layout: SequenceLayout = layout_of(carrier)
    return layout.input_ids.reshape(-1) - 1


def layout_routes(layout_of, rows: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The records of micro-batch ``rows`` in the order its layout's tokens enter the model (``layout_sources``),
    [T, layers, k] (int16, -1: not recorded, or layout padding), and each such token's row in ``rows`` [T] (-1 for
    layout padding)."""
    routes = rows[ROUTED_EXPERTS]
    batch, width = routes.shape[:2]
    source = layout_sources(layout_of, rows)
    flat = routes.reshape(batch * width, *routes.shape[2:])
    taken = torch.where((source >= 0)[:, None, None], flat[source.clamp(min=0)], NOT_RECORDED)
    return taken, torch.where(source >= 0, source // width, -1)


class RouteCounts:
    """Per row of a micro-batch, on the device, summed over the MoE layers (``ROUTE_COUNTS``'s columns): recorded
    (token, layer) routings, those whose top-k set differs from the record, recorded expert choices, and those
    not in the top-k (whole numbers, exact in float32 up to 2**24 a row)."""

    COLUMNS = 4

    def __init__(self, rows: int, token_rows: torch.Tensor) -> None:
        self.counts = torch.zeros(
            rows + 1, self.COLUMNS, device=token_rows.device
        )  # the last row: layout padding
        self.token_rows = torch.where(token_rows >= 0, token_rows, rows)

    def add(self, recorded: torch.Tensor, live: torch.Tensor) -> None:
        present = (recorded >= 0).all(dim=-1)
        missed = ~(recorded.unsqueeze(-1) == live.unsqueeze(-2)).any(
            dim=-1
        )  # a recorded expert not in the live top-k
        choices = present.float() * recorded.shape[-1]
        per_token = torch.stack(
            [
                present.float(),
                (present & missed.any(dim=-1)).float(),
                choices,
                (missed & present.unsqueeze(-1)).float().sum(dim=-1),
            ],
            dim=-1,
        )
        self.counts.index_add_(0, self.token_rows, per_token)

    @property
    def per_row(self) -> torch.Tensor:
        return self.counts[:-1]


def _replay_hook(routes: torch.Tensor, replay: bool, counts: RouteCounts | None):
    """A forward hook for one router: its (logits, weights, ids) output with the recorded ids where there are
    some (``replay``) and the gate weights gathered there from the trainer's own softmax."""

    def hook(gate: nn.Module, args, output):
        logits, weights, live = output
        if counts is not None:
            counts.add(routes, live)
        if not replay:
            return output
        router = router_of(gate)
        chosen = torch.where(routes >= 0, routes, live)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        gathered = probs.gather(-1, chosen)
        if router.norm_topk_prob:
            gathered = gathered / gathered.sum(dim=-1, keepdim=True)
        return logits, gathered.to(weights.dtype), chosen

    return hook


@contextlib.contextmanager
def replaying(
    model: nn.Module, routes: torch.Tensor, *, replay: bool = True, counts: RouteCounts | None = None
) -> Iterator[None]:
    """Inside the block, each sparse block's router takes ``routes`` [T, layers, k] (``layout_routes``, on the
    model's device): layer l routes token t to ``routes[t, l]`` where recorded (``replay``; else its own top-k),
    and ``counts`` (if given) adds how often its own top-k differs. Layers run eagerly inside."""
    gates = sparse_gates(model)
    if len(gates) != routes.shape[1]:
        raise ArcherError(
            f"the batch's routed_experts hold {routes.shape[1]} MoE layers but the policy has {len(gates)}",
            "record the routing with the policy's own engine (rollout.name=fast)",
        )
    handles = [
        gate.register_forward_hook(_replay_hook(routes[:, i].long(), replay, counts))
        for i, gate in enumerate(gates)
    ]
    try:
        with eager_layers():
            yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def recording(model: nn.Module, picked: list[torch.Tensor]) -> Iterator[None]:
    """Inside the block, each sparse block's router appends its own top-k ids [T, k] to ``picked`` (layer order)."""
    handles = [
        gate.register_forward_hook(lambda _, args, out: picked.append(out[2])) for gate in sparse_gates(model)
    ]
    try:
        with eager_layers():
            yield
    finally:
        for handle in handles:
            handle.remove()


def own_routes(
    model: nn.Module, layout_of, rows: Batch
) -> tuple[contextlib.AbstractContextManager, Callable]:
    """R2's record of micro-batch ``rows``: a context to run its forward in, and a function that then gives the
    routers' own top-k laid out as ``routed_experts`` [B, W, layers, k] (int16, on the host; -1 off the tokens)."""
    picked: list[torch.Tensor] = []
    source = layout_sources(layout_of, rows)
    batch, width = rows["attention_mask"].shape

    def taken() -> torch.Tensor:
        ids = torch.stack(picked, dim=1).to(torch.int16).cpu()  # [T, layers, k]
        out = torch.full((batch * width, *ids.shape[1:]), NOT_RECORDED, dtype=torch.int16)
        present = source >= 0
        out[source[present]] = ids[present]
        return out.view(batch, width, *ids.shape[1:])

    return recording(model, picked), taken


def micro_batch_replay(
    model: nn.Module, layout_of, rows: Batch, device: torch.device, *, replay: bool, count: bool
) -> tuple[contextlib.AbstractContextManager, RouteCounts | None]:
    """``replaying`` for micro-batch ``rows`` (which hold ``routed_experts``) and its counts (``count``), or a
    no-op context where the rows hold no records."""
    if ROUTED_EXPERTS not in rows.tensors:
        return contextlib.nullcontext(), None
    routes, token_rows = layout_routes(layout_of, rows)
    counts = RouteCounts(len(rows), to_device(token_rows, device)) if count else None  # no wait for the GPU
    return replaying(model, to_device(routes, device), replay=replay, counts=counts), counts


def mismatch_metrics(counts: torch.Tensor) -> dict[str, float]:
    """``actor/router_mismatch_tokens`` and ``actor/router_mismatch_choices`` of the rows' ``ROUTE_COUNTS``."""
    recorded, tokens, choices, missed = counts.double().sum(dim=0).tolist()
    if not recorded:
        return {}
    return {
        "actor/router_mismatch_tokens": tokens / recorded,
        "actor/router_mismatch_choices": missed / choices,
    }
