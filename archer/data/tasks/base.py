"""What a built-in task is: a generator of verifiable instances plus the reward it is scored by."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from archer.errors import ArcherError


@dataclass(frozen=True)
class TaskInstance:
    """One generated problem: the user question, a worked solution, the gold answer and an identity key.

    ``key`` identifies the problem regardless of its wording (two instances with the same key are the
    same problem); train and validation sets never share a key.
    """

    question: str
    solution: str
    ground_truth: str
    key: str


@dataclass(frozen=True)
class Task:
    """A built-in task: ``make_instance(rng, **knobs)`` draws one instance; rows carry data_source/ability."""

    data_source: str
    ability: str
    make_instance: Callable[..., TaskInstance]


def check_int_knob(task: str, name: str, value: object, minimum: int) -> int:
    """``value`` as an int of at least ``minimum``, else an ArcherError naming the knob."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ArcherError(
            f"task {task!r}: knob {name}={value!r} must be an integer >= {minimum}",
            f"pass {name}=<integer >= {minimum}>",
        )
    return value


def check_fraction_knob(task: str, name: str, value: object) -> float:
    """``value`` as a float in [0, 1], else an ArcherError naming the knob."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ArcherError(f"task {task!r}: knob {name}={value!r} must be a number in [0, 1]",
                          f"pass {name}=<a fraction of the solutions, e.g. 0.5>")
    return float(value)


def check_ops_knob(task: str, ops: str | Sequence[str], allowed: str) -> str:
    """The operators of ``ops`` (a string like "+-" or a list of symbols), each one of ``allowed``."""
    symbols = "".join(ops)
    if not symbols or set(symbols) - set(allowed):
        raise ArcherError(
            f"task {task!r}: knob ops={ops!r} must be a non-empty string of operators from {allowed!r}",
            f"pass e.g. ops={allowed!r}",
        )
    return "".join(dict.fromkeys(symbols))
