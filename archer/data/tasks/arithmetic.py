"""Multi-step integer arithmetic: "Compute 37+45-18." -> "37+45=82. 82-18=64. \\boxed{64}".

Products are worked out first (left to right), then sums and differences left to right, one step per
operator, so every solution is a short chain of two-operand facts. Difficulty knobs: ``num_operands``,
``max_operand`` (operands are drawn from 1..max_operand) and ``ops`` (from "+-*").

``unboxed_fraction`` makes that fraction of the solutions end in prose ("The answer is 64.") instead of
``\\boxed{64}``: warm-start data that mixes answer formats, as real SFT data does. The math reward only
reads a boxed answer, so RL has a behaviour to select; the quickstart relies on it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from archer.data.tasks.base import TaskInstance, check_fraction_knob, check_int_knob, check_ops_knob

DATA_SOURCE = "archer/arithmetic"
ABILITY = "math"
_NAME = "arithmetic"


def _apply(a: int, op: str, b: int) -> int:
    if op == "*":
        return a * b
    return a + b if op == "+" else a - b


def work_out(operands: Sequence[int], ops: Sequence[str]) -> tuple[list[str], int]:
    """The steps ("a*b=c.") that evaluate ``operands`` joined by ``ops``, and the result."""
    values, pending, steps = list(operands), list(ops), []
    while pending:
        j = pending.index("*") if "*" in pending else 0
        a, op, b = values[j], pending.pop(j), values[j + 1]
        values[j : j + 2] = [_apply(a, op, b)]
        steps.append(f"{a}{op}{b}={values[j]}.")
    return steps, values[0]


def draw_expression(rng: random.Random, count: int, low: int, high: int, symbols: Sequence[str]
                    ) -> tuple[list[int], list[str], str]:
    """``count`` operands in low..high and ``count - 1`` operators drawn from ``symbols``, and their text."""
    operands = [rng.randint(low, high) for _ in range(count)]
    chosen = [rng.choice(symbols) for _ in range(count - 1)]
    return operands, chosen, str(operands[0]) + "".join(f"{op}{x}" for op, x in zip(chosen, operands[1:], strict=True))


def make_instance(
    rng: random.Random,
    *,
    num_operands: int = 3,
    max_operand: int = 99,
    ops: str | Sequence[str] = "+-",
    unboxed_fraction: float = 0.0,
) -> TaskInstance:
    """One arithmetic problem with its worked solution (ending in prose with probability unboxed_fraction)."""
    unboxed_fraction = check_fraction_knob(_NAME, "unboxed_fraction", unboxed_fraction)
    count = check_int_knob(_NAME, "num_operands", num_operands, 2)
    top = check_int_knob(_NAME, "max_operand", max_operand, 1)
    symbols = check_ops_knob(_NAME, ops, "+-*")
    operands, chosen, expression = draw_expression(rng, count, 1, top, symbols)
    steps, answer = work_out(operands, chosen)
    unboxed = unboxed_fraction > 0 and rng.random() < unboxed_fraction
    final = f"The answer is {answer}." if unboxed else f"\\boxed{{{answer}}}"
    return TaskInstance(
        question=f"Compute {expression}.",
        solution=" ".join(steps) + " " + final,
        ground_truth=str(answer),
        key=expression,
    )
