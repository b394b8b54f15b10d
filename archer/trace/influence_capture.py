"""Per-token gradients of linear layers, captured by hooks during a real backward pass (REFERENCE.md s.11).

For a linear layer y = W x, the gradient of the loss w.r.t. W is a sum over positions of rank-1 terms
dy_t x_t^T. A forward hook stores x_t of the traced positions, already projected (v_t = P_in x_t); a hook on
the layer's output tensor receives dy during backward and stores u_t = P_out dy_t. The projected per-token
gradient is u_t v_t^T (dimension D = k_in * k_out) and is never formed here. P_in and P_out are seeded
Rademacher matrices scaled by 1/sqrt(k); with projection disabled they are identities and u, v are the raw
vectors.

The influence trace (trace/influence.py) chooses the tokens and sends them to the actor worker as plain arrays
(``TracedTokens``, with the ``CaptureSettings`` given once); the worker hooks its own model (``TokenCapture``)
and hands back plain tensors per module (``InfluenceCapture.collect``). Nothing else crosses between them.

Hooks only fire for positions the caller names with ``micro_batch`` and only while ``capturing``. Under
non-reentrant activation checkpointing the recomputed forward also registers output hooks, but the backward
runs through the original graph, so each position is stored exactly once.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from omegaconf import DictConfig
from torch import nn

from archer.errors import ArcherError


@dataclass(frozen=True)
class ProjectionSpec:
    """How big the projections are: k = ceil(dim / factor), then capped (factor <= 0: no projection)."""

    factor: int = 512
    max_vector_sum: int = -1
    max_dim: int = 2500
    seed: int = 0

    def sizes(self, in_features: int, out_features: int) -> tuple[int, int] | None:
        """(k_in, k_out), or None when the module is not projected."""
        if self.factor <= 0:
            return None
        k_in = math.ceil(in_features / self.factor)
        k_out = math.ceil(out_features / self.factor)
        if self.max_vector_sum > 0 and k_in + k_out > self.max_vector_sum:
            scale = self.max_vector_sum / (k_in + k_out)
            k_in, k_out = max(1, int(k_in * scale)), max(1, int(k_out * scale))
        if self.max_dim > 0 and k_in * k_out > self.max_dim:
            scale = math.sqrt(self.max_dim / (k_in * k_out))
            k_in, k_out = max(1, int(k_in * scale)), max(1, int(k_out * scale))
        return min(k_in, in_features), min(k_out, out_features)


def rademacher(rows: int, cols: int, seed: int) -> torch.Tensor:
    """A [rows, cols] matrix of +-1/sqrt(rows) drawn from ``seed`` (the same on every device)."""
    generator = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (rows, cols), generator=generator, dtype=torch.int8)
    return (signs.float() * 2 - 1) / math.sqrt(rows)


def projection_matrices(name: str, module: nn.Linear, spec: ProjectionSpec
                        ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(P_in [k_in, in], P_out [k_out, out]) of a module, on its device, seeded by the module's name; (None, None)
    when it is not projected."""
    sizes = spec.sizes(module.in_features, module.out_features)
    if sizes is None:
        return None, None
    seed = spec.seed * 1_000_003 + zlib.crc32(name.encode())
    device = module.weight.device
    return (rademacher(sizes[0], module.in_features, seed).to(device),
            rademacher(sizes[1], module.out_features, seed + 1).to(device))


def select_modules(model: nn.Module, name_filter: list[str], layers: list[int] | None,
                   max_modules: int) -> dict[str, nn.Linear]:
    """Linear modules whose name ends with a filter entry, in the chosen decoder layers, nearest the output last.

    ``layers`` are indices into the decoder layers (negative counts from the end); None means all.
    ``max_modules`` > 0 keeps the last N matches (those closest to the output).
    """
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    matched = {name: m for name, m in linears.items()
               if any(name == f or name.endswith("." + f) for f in name_filter)}
    if layers is not None:
        num_layers = int(getattr(model.config, "num_hidden_layers", 0))
        wanted = {i % num_layers for i in layers} if num_layers else set(layers)
        matched = {name: m for name, m in matched.items() if _layer_index(name) in wanted}
    if max_modules > 0:
        matched = dict(list(matched.items())[-max_modules:])
    if not matched:
        examples = ", ".join(list(linears)[:6])
        raise ArcherError(f"trainer.influence_trace.module_name_filter={list(name_filter)} (layers={layers}) "
                          f"matches no linear module of the model",
                          f"use suffixes of linear module names, e.g. mlp.down_proj; the model has {examples}, ...")
    return matched


def _layer_index(name: str) -> int | None:
    found = re.search(r"\.layers\.(\d+)\.", f".{name}.")
    return int(found.group(1)) if found else None


@dataclass
class ModuleCapture:
    """What one hooked module collected: token ids (into the traced-token list) and their u, v vectors."""

    p_in: torch.Tensor | None
    p_out: torch.Tensor | None
    tokens: list[torch.Tensor] = field(default_factory=list)
    u: list[torch.Tensor] = field(default_factory=list)
    v: list[torch.Tensor] = field(default_factory=list)

    def project(self, values: torch.Tensor, side: str) -> torch.Tensor:
        matrix = self.p_in if side == "in" else self.p_out
        values = values.float()
        return values if matrix is None else values @ matrix.t()


@dataclass
class MicroBatchPositions:
    """Traced positions of one micro-batch: batch rows, sequence positions and their traced-token ids."""

    rows: torch.Tensor
    positions: torch.Tensor
    token_ids: torch.Tensor


class InfluenceCapture:
    """Hooks on the selected modules that store projected per-token gradient factors."""

    def __init__(self, modules: dict[str, nn.Linear], spec: ProjectionSpec, *, store_device: torch.device) -> None:
        self.modules = modules
        self.store_device = store_device
        self.captures = {name: ModuleCapture(*projection_matrices(name, module, spec))
                         for name, module in modules.items()}
        self.current: MicroBatchPositions | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    @property
    def dims(self) -> dict[str, tuple[int, int]]:
        """(k_in, k_out) of each module."""
        out = {}
        for name, cap in self.captures.items():
            module = self.modules[name]
            out[name] = (module.in_features if cap.p_in is None else cap.p_in.shape[0],
                         module.out_features if cap.p_out is None else cap.p_out.shape[0])
        return out

    @contextmanager
    def capturing(self) -> Iterator[InfluenceCapture]:
        """Hooks installed for the duration of the block."""
        for name, module in self.modules.items():
            self._handles.append(module.register_forward_hook(self._forward_hook(name)))
        try:
            yield self
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            self.current = None

    @contextmanager
    def micro_batch(self, positions: MicroBatchPositions | None) -> Iterator[None]:
        """Name the traced positions of the micro-batch whose forward and backward run inside the block."""
        self.current = None
        if positions is not None and positions.rows.numel():
            device = next(iter(self.modules.values())).weight.device
            self.current = MicroBatchPositions(positions.rows.to(device), positions.positions.to(device),
                                               positions.token_ids.to(self.store_device))
        try:
            yield
        finally:
            self.current = None

    def _forward_hook(self, name: str):
        capture = self.captures[name]

        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            where = self.current
            if where is None or not torch.is_grad_enabled() or not output.requires_grad:
                return
            rows, positions, token_ids = where.rows, where.positions, where.token_ids
            v = capture.project(inputs[0].detach()[rows, positions], "in")

            def grad_hook(grad: torch.Tensor) -> None:
                u = capture.project(grad.detach()[rows, positions], "out")
                capture.tokens.append(token_ids)
                capture.u.append(u.to(self.store_device))
                capture.v.append(v.to(self.store_device))

            output.register_hook(grad_hook)

        return hook

    def collect(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per module: (token ids [T], u [T, k_out], v [T, k_in]) sorted by token id (empty when none)."""
        out = {}
        for name, cap in self.captures.items():
            if not cap.tokens:
                k_in, k_out = self.dims[name]
                out[name] = (torch.zeros(0, dtype=torch.long), torch.zeros(0, k_out), torch.zeros(0, k_in))
                continue
            tokens = torch.cat(cap.tokens)
            order = torch.argsort(tokens)
            out[name] = (tokens[order], torch.cat(cap.u)[order], torch.cat(cap.v)[order])
        return out


CapturedFactors = dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # module -> (token ids, u, v) on CPU


@dataclass(frozen=True)
class CaptureSettings:
    """What the actor hooks and how (trainer.influence_trace keys), given to the actor worker once."""

    module_name_filter: tuple[str, ...]
    layers: tuple[int, ...] | None
    max_modules: int
    projection: ProjectionSpec
    offload_to_cpu: bool
    output_function: str
    skip_optimizer_step: bool

    @classmethod
    def from_config(cls, t: DictConfig) -> CaptureSettings:
        return cls(module_name_filter=tuple(t.module_name_filter),
                   layers=None if t.layers is None else tuple(int(i) for i in t.layers),
                   max_modules=int(t.max_modules),
                   projection=ProjectionSpec(factor=int(t.projection_dim_factor), max_vector_sum=int(t.max_proj_vector_sum),
                                             max_dim=int(t.max_hessian_dim), seed=int(t.projection_seed)),
                   offload_to_cpu=bool(t.grad_offload_to_cpu), output_function=str(t.output_function),
                   skip_optimizer_step=bool(t.skip_optimizer_step))

    @property
    def extra_pass(self) -> bool:
        """Whether the capture needs its own forward+backward (every output function but the training loss)."""
        return self.output_function != "training_loss"


@dataclass(frozen=True)
class TracedTokens:
    """The tokens of one step to capture: ``rows`` of the batch, and per token its index into ``rows``
    (ascending) and its response position. Token i of the capture is token i of these arrays."""

    rows: np.ndarray            # [S] batch rows
    token_response: np.ndarray  # [T] index into rows, non-decreasing
    token_position: np.ndarray  # [T] response position


class TokenCapture:
    """The actor's side of one traced update: its hooks, and the traced positions of each micro-batch."""

    def __init__(self, capture: InfluenceCapture, tokens: TracedTokens) -> None:
        self.capture = capture
        self.tokens = tokens
        # batch row -> (id of its first traced token, its traced response positions)
        self._by_row: dict[int, tuple[int, np.ndarray]] = {}
        index = np.arange(len(tokens.rows))
        starts = np.searchsorted(tokens.token_response, index)
        ends = np.searchsorted(tokens.token_response, index, side="right")
        for s, row in enumerate(tokens.rows):
            self._by_row[int(row)] = (int(starts[s]), tokens.token_position[starts[s]:ends[s]])

    def hooks(self):
        return self.capture.capturing()

    @contextmanager
    def micro_batch(self, rows: Sequence[int], response_start: Sequence[int]) -> Iterator[None]:
        """Trace the selected rows among ``rows`` (batch row ids of the micro-batch) inside the block;
        ``response_start``: the input column of each row's first response token (models/sequence_layout.py)."""
        mb_rows, positions, token_ids = [], [], []
        for i, (row, start) in enumerate(zip(rows, response_start, strict=True)):
            found = self._by_row.get(int(row))
            if found is None:
                continue
            first, pos = found
            mb_rows.append(np.full(len(pos), i))
            # The hidden state at input column start - 1 + t scores response token t.
            positions.append(int(start) - 1 + pos)
            token_ids.append(first + np.arange(len(pos)))
        where = None
        if mb_rows:
            where = MicroBatchPositions(torch.as_tensor(np.concatenate(mb_rows)),
                                        torch.as_tensor(np.concatenate(positions)),
                                        torch.as_tensor(np.concatenate(token_ids)))
        with self.capture.micro_batch(where):
            yield

    def collect(self) -> CapturedFactors:
        """Per module: (token ids, u, v) on the CPU, sorted by token id."""
        return {name: (ids.cpu(), u.cpu(), v.cpu()) for name, (ids, u, v) in self.capture.collect().items()}
