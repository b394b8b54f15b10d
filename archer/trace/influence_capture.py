"""Per-token gradients of linear layers, captured by hooks during a real backward pass (docs/traces.md).

For a linear layer y = W x, the gradient of the loss w.r.t. W is a sum over positions of rank-1 terms
dy_t x_t^T. A forward hook keeps x_t of the traced positions, already projected (v_t = P_in x_t); a hook on
the layer's output tensor receives dy during backward and stores u_t = P_out dy_t with v_t. The projected
per-token gradient is u_t v_t^T (dimension D = k_in * k_out) and is never formed here. P_in and P_out are
seeded Rademacher matrices scaled by 1/sqrt(k); with projection disabled they are identities and u, v are the
raw vectors.

Cost: a hook projects the whole activation or gradient of its micro-batch with one matrix product by the +-1
signs of P (reading it once, in its own dtype, and writing k numbers per position) and keeps the traced
positions; when the micro-batch ends, the factors of all modules of equal (k_in, k_out) go into that group's
buffers on the store device in one copy per side. No copy of the traced rows, no host synchronisation (unless
the store device is the CPU), projections made once per run (``module_projections``), and the scoring takes
each group of modules in one batched computation.

The influence trace (trace/influence.py) chooses the tokens and sends them to the actor worker as plain arrays
(``TracedTokens``, with the ``CaptureSettings`` given once); the worker hooks its own model (``TokenCapture``)
and hands back plain tensors per group of modules (``InfluenceCapture.collect``). Nothing else crosses
between them.

Hooks only fire for positions the caller names with ``micro_batch`` and only while ``capturing``. Under
non-reentrant activation checkpointing the recomputed forward also registers output hooks, but the backward
runs through the original graph, so each position is stored exactly once (``collect`` checks the count).
"""

from __future__ import annotations

import functools
import math
import re
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from omegaconf import DictConfig
from peft.tuners.lora import LoraLayer
from torch import nn

from archer.errors import ArcherError
from archer.models.compiled_layers import eager_layers


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
    A layer with LoRA (peft's LoraLayer around the linear layer, under the linear layer's name) is hooked
    whole: its input is the base layer's, and its output gradient is the base output's, so the captured
    dy_t x_t^T is the per-token gradient of the effective (merged) weight; the modules inside it are not
    candidates.
    """
    lora = tuple(f"{name}." for name, m in model.named_modules() if isinstance(m, LoraLayer))
    linears = {name: m for name, m in model.named_modules()
               if (isinstance(m, nn.Linear) and not name.startswith(lora))
               or (isinstance(m, LoraLayer) and isinstance(m.get_base_layer(), nn.Linear))}
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


SIGN_DTYPES = (torch.float32, torch.bfloat16)  # float32, and the GPU autocast's dtype (others: via float32)


@dataclass(frozen=True)
class ModuleProjection:
    """How one module's factors are made: its (k_in, k_out), and per side the +-1 signs of P, transposed
    ([features, k]) and ready in each of ``SIGN_DTYPES``; no signs when the module is not projected. P's
    entries are these signs times 1/sqrt(k) (``scales``)."""

    dims: tuple[int, int]
    signs_in: dict[torch.dtype, torch.Tensor] | None
    signs_out: dict[torch.dtype, torch.Tensor] | None

    @staticmethod
    def of(name: str, module: nn.Linear, spec: ProjectionSpec) -> ModuleProjection:
        p_in, p_out = projection_matrices(name, module, spec)
        if p_in is None:
            return ModuleProjection((module.in_features, module.out_features), None, None)
        return ModuleProjection((p_in.shape[0], p_out.shape[0]),
                                {dtype: p_in.sign().t().contiguous().to(dtype) for dtype in SIGN_DTYPES},
                                {dtype: p_out.sign().t().contiguous().to(dtype) for dtype in SIGN_DTYPES})

    @property
    def scales(self) -> tuple[float, float]:
        """What the sign projections are multiplied by: (1/sqrt(k_in), 1/sqrt(k_out)), or 1 unprojected."""
        if self.signs_in is None:
            return 1.0, 1.0
        return 1 / math.sqrt(self.dims[0]), 1 / math.sqrt(self.dims[1])


def module_projections(modules: dict[str, nn.Linear], spec: ProjectionSpec) -> dict[str, ModuleProjection]:
    """The projections of the hooked modules, made once per run (every traced step reuses them)."""
    return {name: ModuleProjection.of(name, module, spec) for name, module in modules.items()}


@functools.cache
def float32_products_supported(device: torch.device) -> bool:
    """Whether ``torch.mm`` gives float32 products of bfloat16 matrices on ``device`` (CUDA, torch >= 2.8)."""
    if device.type != "cuda":
        return False
    try:
        ones = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
        return torch.mm(ones, ones, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def sign_products(values: torch.Tensor, signs: dict[torch.dtype, torch.Tensor], float32_out: bool) -> torch.Tensor:
    """``values`` [N, features] times the signs [features, k], in float32. ``values`` is read once in its own
    dtype: +-1 is exact in each, and the products are summed in float32 (returned as float32 where
    ``float32_out``, else rounded to that dtype first)."""
    if values.dtype not in signs or values.dtype == torch.float32:
        return values.float() @ signs[torch.float32]
    if float32_out:
        return torch.mm(values, signs[values.dtype], out_dtype=torch.float32)
    return (values @ signs[values.dtype]).float()


@dataclass
class FactorGroup:
    """The factors of the hooked modules that share (k_in, k_out), stacked along a module axis: u [M, T, k_out]
    and v [M, T, k_in] (float32), token t of the capture at index t."""

    modules: list[str]
    u: torch.Tensor
    v: torch.Tensor


CapturedFactors = list[FactorGroup]


@dataclass
class MicroBatchPositions:
    """Traced positions of one micro-batch of ``shape`` (rows, sequence length): their indices into the
    flattened rows x positions, and their traced-token ids."""

    index: torch.Tensor
    token_ids: torch.Tensor
    shape: tuple[int, int]


class InfluenceCapture:
    """Hooks on the selected modules that store projected per-token gradient factors of ``num_tokens`` tokens.

    A hook projects the whole activation (or gradient) with one matrix product, which reads it once and
    writes k numbers per position, and then picks the traced positions. At the end of each micro-batch the
    factors of each group of modules with equal (k_in, k_out) go into that group's buffers on
    ``store_device`` in one copy per side. Projections multiply by the +-1 signs of P; the 1/sqrt(k) scale is
    applied once per buffer in ``collect``.
    """

    def __init__(self, modules: dict[str, nn.Linear], projections: dict[str, ModuleProjection], *,
                 num_tokens: int, store_device: torch.device) -> None:
        self.modules = modules
        self.num_tokens = num_tokens
        self.store_device = store_device
        self.projections = projections
        names_by_dims: dict[tuple[int, int], list[str]] = {}
        for name, projection in self.projections.items():
            names_by_dims.setdefault(projection.dims, []).append(name)
        self.groups = [FactorGroup(names, torch.zeros(len(names), num_tokens, k_out, device=store_device),
                                   torch.zeros(len(names), num_tokens, k_in, device=store_device))
                       for (k_in, k_out), names in names_by_dims.items()]
        self._slot = {name: (g, m) for g, group in enumerate(self.groups) for m, name in enumerate(group.modules)}
        # (u, v) of the current micro-batch per group and module, until the micro-batch ends
        self._pending: list[list[tuple[torch.Tensor, torch.Tensor] | None]] = []
        self._captured = dict.fromkeys(modules, 0)  # tokens captured per module
        self._scaled = False
        self._float32_out = float32_products_supported(next(iter(modules.values())).weight.device)
        self.current: MicroBatchPositions | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    @contextmanager
    def capturing(self) -> Iterator[InfluenceCapture]:
        """Hooks installed for the duration of the block, in which compiled decoder layers run eagerly (every
        hooked layer's call must reach its hook; models/compiled_layers.py)."""
        for name, module in self.modules.items():
            self._handles.append(module.register_forward_hook(self._forward_hook(name)))
        try:
            with eager_layers():
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
        self._pending = [[None] * len(group.modules) for group in self.groups]
        if positions is not None and positions.index.numel():
            device = next(iter(self.modules.values())).weight.device
            self.current = MicroBatchPositions(positions.index.to(device), positions.token_ids.to(self.store_device),
                                               positions.shape)
        try:
            yield
            if self.current is not None:
                self._store(self.current)
        finally:
            self.current = None
            self._pending = []

    def _store(self, where: MicroBatchPositions) -> None:
        """Write the micro-batch's factors into the group buffers (a group missing a module is left out:
        ``collect`` names the module)."""
        for group, pending in zip(self.groups, self._pending):
            if any(factors is None for factors in pending):
                continue
            group.u.index_copy_(1, where.token_ids, torch.stack([u for u, _ in pending]).to(self.store_device))
            group.v.index_copy_(1, where.token_ids, torch.stack([v for _, v in pending]).to(self.store_device))

    def _factors(self, values: torch.Tensor, where: MicroBatchPositions,
                 signs: dict[torch.dtype, torch.Tensor] | None) -> torch.Tensor:
        """[traced positions, k] float32: the sign projection of ``values`` [rows, length, features] there."""
        if tuple(values.shape[:-1]) != where.shape:
            raise RuntimeError(f"influence hook saw a tensor of shape {tuple(values.shape)}; the micro-batch has "
                               f"(rows, length) = {where.shape}")
        flat = values.detach().reshape(-1, values.shape[-1])
        if signs is None:
            return flat.index_select(0, where.index).float()
        if torch.is_autocast_enabled(flat.device.type):  # the forward runs under autocast on the GPU
            with torch.autocast(flat.device.type, enabled=False):
                return sign_products(flat, signs, self._float32_out).index_select(0, where.index)
        return sign_products(flat, signs, self._float32_out).index_select(0, where.index)

    def _forward_hook(self, name: str):
        projection = self.projections[name]
        g, m = self._slot[name]

        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            where = self.current
            if where is None or not torch.is_grad_enabled() or not output.requires_grad:
                return
            v = self._factors(inputs[0], where, projection.signs_in)

            def grad_hook(grad: torch.Tensor) -> None:
                self._pending[g][m] = (self._factors(grad, where, projection.signs_out), v)
                self._captured[name] += len(where.token_ids)

            output.register_hook(grad_hook)

        return hook

    @property
    def captured(self) -> dict[str, int]:
        """Tokens captured so far per module."""
        return dict(self._captured)

    def collect(self, *, complete: bool = True) -> CapturedFactors:
        """The factor groups (scaled in place, once); with ``complete`` every module must have captured every
        token exactly once (a data-parallel rank captures only its rows' tokens: ``merge_rank_factors``)."""
        if complete:
            check_counts(self._captured, self.num_tokens)
        if not self._scaled:
            for group in self.groups:
                scale_in, scale_out = self.projections[group.modules[0]].scales
                group.u.mul_(scale_out)
                group.v.mul_(scale_in)
            self._scaled = True
        return self.groups


def check_counts(captured: dict[str, int], num_tokens: int) -> None:
    """Every module captured every traced token exactly once."""
    for name, count in captured.items():
        if count != num_tokens:
            raise RuntimeError(f"influence capture of {name} captured {count} factors for {num_tokens} traced tokens")


def merge_rank_factors(ranks: list[tuple[CapturedFactors, dict[str, int]]], num_tokens: int) -> CapturedFactors:
    """The factors of a data-parallel update: each rank's (factor groups, tokens captured per module), each rank
    having written only the tokens of its rows (zeros elsewhere). The groups are summed; together the ranks must
    have captured every token of every module exactly once."""
    first, _ = ranks[0]
    totals: dict[str, int] = {}
    for _, captured in ranks:
        for name, count in captured.items():
            totals[name] = totals.get(name, 0) + count
    check_counts(totals, num_tokens)
    return [FactorGroup(group.modules, sum(r[0][g].u for r in ranks), sum(r[0][g].v for r in ranks))
            for g, group in enumerate(first)]


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
    def micro_batch(self, rows: Sequence[int], first_predictor: Sequence[int], shape: tuple[int, int]
                    ) -> Iterator[None]:
        """Trace the selected rows among ``rows`` (batch row ids of the micro-batch) inside the block;
        ``first_predictor``: the flat input position whose output scores each row's first response token,
        ``shape``: the input's (rows, columns), padded or packed (models/sequence_layout.py)."""
        index, token_ids = [], []
        for row, first_position in zip(rows, first_predictor, strict=True):
            found = self._by_row.get(int(row))
            if found is None:
                continue
            first, pos = found
            # The hidden state at flat position first_position + t scores response token t.
            index.append(int(first_position) + pos)
            token_ids.append(first + np.arange(len(pos)))
        where = None
        if index:
            where = MicroBatchPositions(torch.as_tensor(np.concatenate(index)),
                                        torch.as_tensor(np.concatenate(token_ids)), tuple(shape))
        with self.capture.micro_batch(where):
            yield

    def collect(self, *, complete: bool = True) -> CapturedFactors:
        """The captured factors, on the capture's store device (``complete``: see InfluenceCapture.collect)."""
        return self.capture.collect(complete=complete)
