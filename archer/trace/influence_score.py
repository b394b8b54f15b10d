"""Influence scores of tokens from their projected rank-1 gradients (pure torch, docs/traces.md).

Token t of response r has the projected gradient g_t = vec(u_t v_t^T) in one module. With G the stacked
response gradients G_r (mean or sum of their token gradients) of a scope (one prompt group, or all selected
responses), and d = agg_{accepted} G_r - agg_{rejected} G_r the contrastive direction,

    inverse mode:   s_t = d^T (G^T G + lambda I)^{-1} g_t,   lambda = 0.1 * trace(G^T G) / D unless set
    identity mode:  s_t = d^T g_t

and the token's score is the sum over modules. With w = (G^T G + lambda I)^{-1} d reshaped to [k_out, k_in],
s_t = u_t^T w v_t, so g_t is never formed. The solve uses the Woodbury identity (an n x n Cholesky system for
n responses) when n < D, else a D x D Cholesky solve.

Modules of equal (k_in, k_out) are scored together: their factors come stacked along a module axis, and
every step is one batched computation over it (in chunks of modules, to bound memory). Tokens are laid out
on a [responses, longest response] grid (``Grid``), so that G_r = U_r^T V_r and the scores of a response's
tokens, rows of V_r w^T times U_r, are batched matrix products.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from archer.errors import ArcherError


@dataclass(frozen=True)
class ScoreOptions:
    mode: str = "inverse"               # inverse | identity
    reg_lambda: float = -1.0            # negative: 0.1 * trace(G^T G) / D
    scope: str = "per_prompt"           # per_prompt | all_selected
    contrastive_agg: str = "sum"        # sum | mean
    response_grad_agg: str = "mean"     # mean | sum
    exclude_self_response: bool = False

    @classmethod
    def from_config(cls, t: DictConfig) -> ScoreOptions:
        """The options of a ``trainer.influence_trace`` block (checked)."""
        return cls(mode=str(t.hessian_mode), reg_lambda=float(t.reg_lambda), scope=str(t.accepted_rejected_scope),
                   contrastive_agg=str(t.contrastive_agg), response_grad_agg=str(t.response_grad_agg),
                   exclude_self_response=bool(t.exclude_self_response))

    def __post_init__(self) -> None:
        for key, value, allowed in (("hessian_mode", self.mode, ("inverse", "identity")),
                                    ("accepted_rejected_scope", self.scope, ("per_prompt", "all_selected")),
                                    ("contrastive_agg", self.contrastive_agg, ("sum", "mean")),
                                    ("response_grad_agg", self.response_grad_agg, ("mean", "sum"))):
            if value not in allowed:
                raise ArcherError(f"trainer.influence_trace.{key}={value!r} is not one of {allowed}",
                                  f"set trainer.influence_trace.{key} to one of {', '.join(allowed)}")


@dataclass(frozen=True)
class Grid:
    """Items laid out by group, padded to the largest group: item i sits at (``row[i]``, ``slot[i]``) of a
    [num_rows, width] grid; ``counts`` [num_rows] are the items per row (slots follow the items' order)."""

    row: torch.Tensor
    slot: torch.Tensor
    counts: torch.Tensor
    num_rows: int
    width: int

    @staticmethod
    def build(row: torch.Tensor, num_rows: int) -> Grid:
        order = torch.argsort(row, stable=True)
        counts = torch.bincount(row, minlength=num_rows)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.empty_like(row)
        slot[order] = torch.arange(len(order), device=order.device) - starts[row[order]]
        return Grid(row, slot, counts, num_rows, int(counts.max()) if len(row) else 0)

    @property
    def cell(self) -> torch.Tensor:
        """[items] index of each item's cell in the flattened grid."""
        return self.row * self.width + self.slot

    def spread(self, values: torch.Tensor) -> torch.Tensor:
        """[M, items, ...] to [M, num_rows, width, ...], zeros where no item sits."""
        out = values.new_zeros(values.shape[0], self.num_rows * self.width, *values.shape[2:])
        return out.index_copy_(1, self.cell, values).view(values.shape[0], self.num_rows, self.width,
                                                          *values.shape[2:])

    def gather(self, grid: torch.Tensor) -> torch.Tensor:
        """[M, num_rows, width, ...] to [M, items, ...]: the items' cells."""
        return grid.reshape(grid.shape[0], self.num_rows * self.width, *grid.shape[3:]).index_select(1, self.cell)


@dataclass(frozen=True)
class Scopes:
    """Responses laid out by scope, padded to the largest scope: [num_scopes, width] slots.

    ``weights`` holds each response's contrast weight c (zero in padding and in scopes without both
    accepted and rejected responses), so d = sum over a scope's slots of c * G_r.
    """

    grid: Grid                  # responses (items) by scope (rows)
    weights: torch.Tensor       # [num_scopes, width] float64

    @staticmethod
    def build(accepted: torch.Tensor, scope_of: torch.Tensor, contrastive_agg: str) -> Scopes:
        _, scope_index = torch.unique(scope_of, return_inverse=True)
        grid = Grid.build(scope_index, int(scope_index.max()) + 1 if scope_index.numel() else 0)
        acc = grid.spread(accepted.to(torch.float64)[None])[0]
        present = grid.spread(torch.ones(1, len(accepted), dtype=torch.float64, device=accepted.device))[0]
        rej = present - acc
        n_acc, n_rej = acc.sum(1, keepdim=True), rej.sum(1, keepdim=True)
        if contrastive_agg == "mean":
            weights = acc / n_acc.clamp(min=1) - rej / n_rej.clamp(min=1)
        else:
            weights = acc - rej
        weights = weights * ((n_acc > 0) & (n_rej > 0))
        return Scopes(grid, weights)


def solve_damped(grads: torch.Tensor, rhs: torch.Tensor, reg_lambda: float) -> torch.Tensor:
    """(G^T G + lambda I)^{-1} rhs per scope, in float64.

    ``grads`` [B, n, D] (zero rows are padding and change nothing), ``rhs`` [B, m, D] (rows are right-hand
    sides). lambda is ``reg_lambda`` or, when negative, 0.1 * trace(G^T G) / D of each scope; a scope whose
    lambda is 0 (no gradient at all) gets zeros.
    """
    g = grads.to(torch.float64)
    b = rhs.to(torch.float64)
    _, n, dim = g.shape
    if reg_lambda >= 0:
        lam = torch.full((g.shape[0], 1, 1), float(reg_lambda), dtype=g.dtype, device=g.device)
    else:
        lam = 0.1 * (g * g).sum(dim=(1, 2), keepdim=True) / dim
    usable = lam > 0
    lam = torch.where(usable, lam, torch.ones_like(lam))
    if n < dim:  # Woodbury: (G^T G + lam I)^-1 = (I - G^T (G G^T + lam I)^-1 G) / lam
        eye = torch.eye(n, dtype=g.dtype, device=g.device)
        chol = torch.linalg.cholesky(g @ g.transpose(1, 2) + lam * eye)
        inner = torch.cholesky_solve(g @ b.transpose(1, 2), chol)            # [B, n, m]
        out = (b - (g.transpose(1, 2) @ inner).transpose(1, 2)) / lam
    else:
        eye = torch.eye(dim, dtype=g.dtype, device=g.device)
        chol = torch.linalg.cholesky(g.transpose(1, 2) @ g + lam * eye)
        out = torch.cholesky_solve(b.transpose(1, 2), chol).transpose(1, 2)
    return out * usable


def module_scores(token_response: torch.Tensor, u: torch.Tensor, v: torch.Tensor, scopes: Scopes,
                  options: ScoreOptions, budget: int = 1 << 24) -> torch.Tensor:
    """Scores [M, T] of the tokens in each of M modules of equal (k_in, k_out), from their factors u [M, T, k_out]
    and v [M, T, k_in]; ``token_response`` [T] maps tokens to responses 0..S-1. Modules are taken a chunk at a
    time, so that a [chunk, S, longest response, k] grid holds about ``budget`` numbers."""
    tokens = Grid.build(token_response, len(scopes.grid.row))
    per_module = tokens.num_rows * tokens.width * (2 * u.shape[2] + v.shape[2])
    chunk = max(1, budget // max(per_module, 1))
    return torch.cat([_chunk_scores(tokens, u[m:m + chunk].float(), v[m:m + chunk].float(), scopes, options)
                      for m in range(0, u.shape[0], chunk)])


def _chunk_scores(tokens: Grid, u: torch.Tensor, v: torch.Tensor, scopes: Scopes, options: ScoreOptions
                  ) -> torch.Tensor:
    modules, k_out, k_in = u.shape[0], u.shape[2], v.shape[2]
    dim = k_out * k_in
    u_grid, v_grid = tokens.spread(u), tokens.spread(v)                     # [M, S, L, k]
    grads = u_grid.transpose(2, 3) @ v_grid                                 # [M, S, k_out, k_in]: G_r
    if options.response_grad_agg == "mean":
        grads = grads / tokens.counts.clamp(min=1).to(grads.dtype)[:, None, None]
    padded = scopes.grid.spread(grads.reshape(modules, -1, dim).to(torch.float64))   # [M, scopes, width, D]
    d = torch.einsum("bn,mbnd->mbd", scopes.weights, padded)
    # One direction per response slot: the scope's d, minus the response's own term when it is left out.
    per_slot = d[:, :, None, :].expand(padded.shape)
    if options.exclude_self_response:
        per_slot = per_slot - scopes.weights[None, :, :, None] * padded
    if options.mode == "inverse":
        batch = (-1, scopes.grid.width, dim)
        per_slot = solve_damped(padded.reshape(batch), per_slot.reshape(batch), options.reg_lambda).reshape(
            padded.shape)
    w = scopes.grid.gather(per_slot).float().reshape(modules, -1, k_out, k_in)   # [M, S, k_out, k_in]
    # [M, S, L]: u_t^T w v_t, through the narrower of w v_t and u_t^T w
    scores = ((v_grid @ w.transpose(2, 3)) * u_grid if k_out <= k_in else (u_grid @ w) * v_grid).sum(-1)
    return tokens.gather(scores)
