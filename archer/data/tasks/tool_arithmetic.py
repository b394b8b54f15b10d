"""Products too large to work out in the head, where a Python call pays: "Compute 682*361." -> the tool-using
solution "<python>print(682*361)</python> <result>\\n246202\\n\\n</result> \\boxed{246202}".

The tiny model cannot multiply two 3-digit numbers in its head, but it can copy the expression into a
``<python>`` call and the printed result into ``\\boxed{}``. Solutions are written in ARPO's tag format: the
text from `` <result>`` to ``</result>`` is what the rollout loop appends after running the call (the frame
`` <result>\\n`` ... ``\\n</result>`` around what the tool answered, i.e. what ``print`` wrote, newline
included); it carries no SFT loss and no policy gradient, so a warm start on these solutions is on the same
tokens RL sees.

Knobs: ``num_operands`` (2), ``min_operand`` / ``max_operand`` (100 / 999: operands are drawn uniformly from
that range), ``ops`` ("*", from "+-*"; Python's precedence, as arithmetic.py works them out) and
``tool_fraction`` (1): the share of solutions that call the tool; the problems drawn do not depend on it
(the quickstart draws operands from 320..999, so that every product has six digits).

The other solutions answer in the head, as a model without a tool would: "In my head, 682*361 is about 244800.
\\boxed{244800}", an estimate from the operands rounded to two significant digits, wrong unless they happen
to be round. Both kinds open with a fixed token (so the share of tool calls is the probability of the
first one) and both copy the expression and box the number before them: the warm start learns that copying
from every solution. The math reward reads the boxed answer, so RL has a behaviour to select: calling the
tool more often; ``archer quickstart task=tool_arithmetic`` relies on it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from archer.data.tasks.arithmetic import draw_expression, work_out
from archer.data.tasks.base import TaskInstance, check_fraction_knob, check_int_knob, check_ops_knob
from archer.errors import ArcherError

DATA_SOURCE = "archer/tool_arithmetic"
ABILITY = "math"
_NAME = "tool_arithmetic"
RESULT_FRAME = (" <result>\n", "\n</result>")  # ARPO's frame around a tool's answer, as the rollout loop writes it
_ESTIMATE_DIGITS = 2


def tool_solution(expression: str, answer: int) -> str:
    """The solution that calls the Python tool: the call; the tool's answer, what ``print`` wrote (its final
    newline included: archer's Python tool answers the output as it is), in the frame the loop appends; the
    boxed answer."""
    result = f"{RESULT_FRAME[0]}{answer}\n{RESULT_FRAME[1]}"
    return f"<python>print({expression})</python>{result} \\boxed{{{answer}}}"


def estimate(value: int, digits: int = _ESTIMATE_DIGITS) -> int:
    """``value`` rounded to ``digits`` significant digits (half up): 4821 -> 4800, 317 -> 320, 95 -> 95."""
    scale = 10 ** max(len(str(value)) - digits, 0)
    return (value + scale // 2) // scale * scale


def make_instance(
    rng: random.Random,
    *,
    num_operands: int = 2,
    min_operand: int = 100,
    max_operand: int = 999,
    ops: str | Sequence[str] = "*",
    tool_fraction: float = 1.0,
) -> TaskInstance:
    """One problem; its solution calls the tool with probability ``tool_fraction``, else it boxes an estimate."""
    fraction = check_fraction_knob(_NAME, "tool_fraction", tool_fraction)
    count = check_int_knob(_NAME, "num_operands", num_operands, 2)
    low = check_int_knob(_NAME, "min_operand", min_operand, 1)
    high = check_int_knob(_NAME, "max_operand", max_operand, 1)
    if high < low:
        raise ArcherError(f"task {_NAME!r}: knob max_operand={high} is below min_operand={low}",
                          "pass max_operand >= min_operand")
    symbols = check_ops_knob(_NAME, ops, "+-*")
    operands, chosen, expression = draw_expression(rng, count, low, high, symbols)
    answer = work_out(operands, chosen)[1]
    uses_tool = rng.random() < fraction
    if uses_tool:
        solution = tool_solution(expression, answer)
    else:
        guess = work_out([estimate(x) for x in operands], chosen)[1]
        solution = f"In my head, {expression} is about {guess}. \\boxed{{{guess}}}"
    return TaskInstance(question=f"Compute {expression}.", solution=solution, ground_truth=str(answer),
                        key=expression)
