"""ARPO's entropy-based adaptive branching and AEPO's entropy-balanced rollout, as pure rules the agentic loop
applies (archer/rollout/agentic.py).

Entropy of a segment (``segment_entropy``): the mean exact full-vocabulary entropy of its first
``entropy_window`` tokens, divided by ln|V| (ARPO sums vLLM's top-10 log-prob entries of the first 20 tokens
instead; archer has the exact entropy). H_init is that of a trajectory's first segment; after each tool answer,
H is that of the segment the model writes next, and dH = H - H_init.

ARPO (``rollout.n``, ``initial_rollouts``, ``beam_size``, ``branch_probability``, ``entropy_weight``): each
prompt starts with ``initial_rollouts`` global samples. At the point right after a tool answer a trajectory tries
``beam_size - 1`` branches (never more than the prompt's free slots of ``n``); each is taken with probability
P = clip(branch_probability + entropy_weight * dH, 0, 1) (ARPO's code draws u and branches when
clip(u - entropy_weight * dH, 0, 1) <= branch_probability: the same rule). A branch copies the trajectory at that
point and samples from there with its own seed.

AEPO (arXiv 2510.14545), two switches:
- ``enable_dynamic_rollouts``: one probe trajectory per prompt measures H_root (its first segment) and H_tool (the
  mean H after its tool answers); the prompt gets m = clip(int(n * sigmoid(beta * (H_root - H_tool))) + 1, 1, n)
  global samples (``dynamic_rollout_beta``, 0.5 in AEPO's code) and n - m slots for branches;
- ``consecutive_branch_penalty`` c (0.05 in AEPO's code; 0 = off): P is multiplied by max(0, 1 - c * l), l the
  number of branch points right before this one on the path that branched in a row (this point not counted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BranchSettings:
    """The branching of one training rollout (validation and greedy decoding never branch)."""

    n: int
    initial_rollouts: int
    beam_size: int = 1
    branch_probability: float = 0.5
    entropy_weight: float = 0.2
    dynamic_rollouts: bool = False
    dynamic_rollout_beta: float = 0.5
    consecutive_branch_penalty: float = 0.0


def segment_entropy(entropies: torch.Tensor, window: int, vocab_size: int) -> float:
    """Mean entropy of the first ``window`` tokens over ln(vocab_size); 0 for an empty segment."""
    head = entropies[:window]
    return float(head.float().mean()) / math.log(vocab_size) if len(head) else 0.0


def branch_probability(settings: BranchSettings, delta: float, consecutive: int) -> float:
    """P(branch) at a tool step whose entropy rose by ``delta`` over H_init, on a path whose last
    ``consecutive`` branch points branched (AEPO's penalty; a no-op when the penalty is 0)."""
    p = min(max(settings.branch_probability + settings.entropy_weight * delta, 0.0), 1.0)
    return p * max(0.0, 1.0 - settings.consecutive_branch_penalty * consecutive)


def global_samples(n: int, h_root: float, h_tool: float, beta: float) -> int:
    """AEPO's global samples of a prompt from its question entropy and its mean tool-step entropy."""
    return min(max(int(n / (1.0 + math.exp(-beta * (h_root - h_tool)))) + 1, 1), n)
