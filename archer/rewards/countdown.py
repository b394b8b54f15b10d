"""Countdown reward: the equation in the last ``<answer>`` block must reach the target.

The equation may use only integers, ``+ - * /`` and parentheses (no unary minus, no ``=``), must use
each given number exactly once, and must evaluate exactly (rational arithmetic) to the target. It is read
with ``ast`` and evaluated by walking the tree; nothing is passed to ``eval``.

Scores follow verl's countdown reward: 1.0 for a correct equation, ``format_score`` (0.1) when an
``<answer>`` block is present but its equation is malformed, uses the wrong numbers or misses the target,
0.0 when there is no answer block. ``acc`` is 1.0 only for a correct equation.
"""

from __future__ import annotations

import ast
import json
import operator
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

from archer.errors import ArcherError
from archer.tagged_text import last_tag_block

FORMAT_SCORE = 0.1
_MAX_EQUATION_CHARS = 1000
_OPERATORS: dict[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def parse_countdown_ground_truth(ground_truth: Mapping[str, Any] | str) -> tuple[int, list[int]]:
    """(target, numbers) from a dict or its JSON / Python-literal string."""
    spec: Any = ground_truth
    if isinstance(ground_truth, str):
        try:
            spec = json.loads(ground_truth)
        except json.JSONDecodeError:
            try:
                spec = ast.literal_eval(ground_truth)
            except (ValueError, SyntaxError):
                spec = None
    try:
        return int(spec["target"]), [int(n) for n in spec["numbers"]]
    except (TypeError, KeyError, ValueError) as exc:
        raise ArcherError(
            f"countdown ground truth {ground_truth!r} is not a {{'target': int, 'numbers': [int, ...]}} "
            f"mapping ({type(exc).__name__}: {exc})",
            'store reward_model.ground_truth as {"target": 24, "numbers": [4, 6, 1]} or its JSON string',
        ) from exc


def _numbers_used(tree: ast.Expression) -> list[int] | None:
    """The integer literals of an equation, or None when it holds anything but + - * / and integers."""
    numbers: list[int] = []
    for node in ast.walk(tree.body):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            numbers.append(node.value)
        elif type(node) not in (ast.BinOp, *_OPERATORS):
            return None
    return numbers


def _evaluate(node: ast.expr) -> Fraction:
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    assert isinstance(node, ast.BinOp)
    return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))


def _equation_is_correct(equation: str, target: int, numbers: list[int]) -> bool:
    if len(equation) > _MAX_EQUATION_CHARS:
        return False
    try:
        tree = ast.parse(equation.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    used = _numbers_used(tree)
    if used is None or sorted(used) != sorted(numbers):
        return False
    try:
        return _evaluate(tree.body) == target
    except ZeroDivisionError:
        return False


def compute_countdown_score(
    solution_str: str, ground_truth: Mapping[str, Any] | str, format_score: float = FORMAT_SCORE
) -> dict[str, float]:
    """{"score": 1.0 | format_score | 0.0, "acc": 1.0 | 0.0} for the equation in the last answer block."""
    target, numbers = parse_countdown_ground_truth(ground_truth)
    block = last_tag_block(solution_str, "<answer>", "</answer>")
    if block is None:
        return {"score": 0.0, "acc": 0.0}
    if _equation_is_correct(block, target, numbers):
        return {"score": 1.0, "acc": 1.0}
    return {"score": format_score, "acc": 0.0}
