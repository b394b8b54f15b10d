"""Which rule reward scores a row: routing by data_source, then by ability.

Order of the routing:
1. a data_source in the table below (exact name), or an AIME variant (any name containing "aime");
2. the benchmark names of ARPO's evaluation (any case): math (gsm8k, math, math500, amc23) -> math; QA (hotpotqa,
   2wiki, bamboogle, musique, gaia, hle, webwalker, simpleqa, xbench, nq, triviaqa, popqa, and Search-R1's
   ``searchR1_<name>``) -> deep-research QA;
3. a row that carries an ``ability`` (ARPO's ``DR_grpo_mix`` and other mixed sources): "math" -> math,
   "qa" -> deep-research QA;
4. ARPO's deep-research evaluation sets (data_source ``DR_*`` without ability) -> QA.
Anything else is an error that names the fix (a custom reward function). ``check_routes`` runs that routing
over a dataset's (data_source, ability) pairs when the data loads, so a source without a reward stops the run
before training, and a source other than ARPO's ``DR_*`` that only its rows' ability routes is named in a
warning with the reward it gets (a source archer does not know is never scored silently).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from archer.errors import ArcherError
from archer.rewards.countdown import compute_countdown_score
from archer.rewards.math import compute_math_score
from archer.rewards.qa import compute_qa_score

log = logging.getLogger("archer.rewards")

Score = float | dict[str, Any]


def _math(solution_str: str, ground_truth: Any) -> Score:
    return compute_math_score(solution_str, str(ground_truth))


def _tool_math(solution_str: str, ground_truth: Any) -> Score:
    """The math reward, plus ``used_tool``: 1 when the response made a Python call (its tool-call rate in the
    metrics)."""
    correct = compute_math_score(solution_str, str(ground_truth))
    return {"score": correct, "acc": correct, "used_tool": float("</python>" in solution_str)}


def _dapo_math(solution_str: str, ground_truth: Any) -> Score:
    """DAPO's math reward: +1 for a correct answer, -1 otherwise."""
    correct = compute_math_score(solution_str, str(ground_truth))
    return {"score": 1.0 if correct else -1.0, "acc": correct}


_MATH_SOURCES = (
    "openai/gsm8k",
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
    "archer/arithmetic",
)
_ROUTES: dict[str, Callable[[str, Any], Score]] = {
    **dict.fromkeys(_MATH_SOURCES, _math),
    "math_dapo": _dapo_math,
    "archer/tool_arithmetic": _tool_math,
    "countdown": compute_countdown_score,
    "archer/countdown": compute_countdown_score,
}
_BENCHMARK_MATH = ("gsm8k", "math", "math500", "amc23")
_BENCHMARK_QA = ("hotpotqa", "2wiki", "2wikimultihopqa", "bamboogle", "musique", "gaia", "hle", "webwalker",
                 "simpleqa", "xbench", "nq", "triviaqa", "popqa")
_SEARCH_R1_PREFIX = "searchr1_"
_BENCHMARK_ROUTES: dict[str, Callable[[str, Any], Score]] = {  # keyed by the lower-case name
    **dict.fromkeys(_BENCHMARK_MATH, _math),
    **dict.fromkeys(_BENCHMARK_QA, compute_qa_score),
}
_ABILITY_ROUTES: dict[str, Callable[[str, Any], Score]] = {"math": _math, "qa": compute_qa_score}
_ABILITY_TEXT = {"math": "the math reward, the last \\boxed{} answer checked with math-verify",
                 "qa": "ARPO's deep-research QA reward, token F1 of the boxed answer in <answer> after a format gate"}
_DEEP_RESEARCH_PREFIX = "DR_"


def known_data_sources() -> list[str]:
    """The data_source names with a built-in reward (AIME variants, searchR1_* and DR_* sources are matched
    too; benchmark names in any case)."""
    return sorted({*_ROUTES, *_BENCHMARK_ROUTES})


def _routes_text() -> str:
    return (f"known data sources: {known_data_sources()} (benchmark names in any case), any name containing "
            f"'aime', searchR1_<QA name>, {_DEEP_RESEARCH_PREFIX}* sources, and rows with ability "
            f"{sorted(_ABILITY_ROUTES)}")


def _source_route(data_source: str) -> Callable[[str, Any], Score] | None:
    """The reward of a data_source by its name alone (steps 1-2), or None."""
    if data_source in _ROUTES:
        return _ROUTES[data_source]
    lower = data_source.lower()
    if "aime" in lower:
        return _math
    benchmark = lower.removeprefix(_SEARCH_R1_PREFIX)
    if benchmark in _BENCHMARK_ROUTES and (benchmark == lower or benchmark in _BENCHMARK_QA):
        return _BENCHMARK_ROUTES[benchmark]
    return None


def _route(data_source: str, ability: str | None) -> Callable[[str, Any], Score]:
    route = _source_route(data_source)
    if route is not None:
        return route
    if ability:
        if ability.lower() not in _ABILITY_ROUTES:
            raise ArcherError(
                f"data_source {data_source!r} has ability {ability!r}, which has no built-in reward "
                f"(known abilities: {sorted(_ABILITY_ROUTES)})",
                "set custom_reward_function.path=FILE custom_reward_function.name=FN",
            )
        return _ABILITY_ROUTES[ability.lower()]
    if data_source.startswith(_DEEP_RESEARCH_PREFIX):
        return compute_qa_score
    raise ArcherError(
        f"no built-in reward for data_source {data_source!r}; {_routes_text()}",
        "write a reward function and set custom_reward_function.path=FILE custom_reward_function.name=FN",
    )


def has_builtin_reward(data_source: str, ability: str | None) -> bool:
    """Whether the routing gives (data_source, ability) a built-in reward."""
    try:
        _route(str(data_source), ability or None)
    except ArcherError:
        return False
    return True


def check_routes(pairs: Iterable[tuple[str, str | None]], where: str) -> None:
    """Every (data_source, ability) pair of a dataset has a built-in reward; else one error naming the sources
    without one (and ``where`` they come from) and the routes there are."""
    pairs = set(pairs)
    missing = {f"{data_source!r}" + (f" (ability {ability!r})" if ability else "")
               for data_source, ability in pairs if not has_builtin_reward(data_source, ability)}
    if missing:
        raise ArcherError(
            f"{where}: no built-in reward for data_source {', '.join(sorted(missing))}; {_routes_text()}",
            "rename the data_source to one of those, or write a reward function and set "
            "custom_reward_function.path=FILE custom_reward_function.name=FN",
        )
    by_ability: dict[str, set[str]] = {}
    for data_source, ability in pairs:
        if _source_route(str(data_source)) is None and not str(data_source).startswith(_DEEP_RESEARCH_PREFIX):
            by_ability.setdefault(str(data_source), set()).add(str(ability).lower())
    for data_source, abilities in sorted(by_ability.items()):
        log.warning("%s: data_source %r has no reward of its own; its rows are scored by the reward of their "
                    "ability (%s: %s). Set custom_reward_function.path=FILE to score it otherwise", where, data_source,
                    ", ".join(sorted(abilities)), "; ".join(_ABILITY_TEXT[a] for a in sorted(abilities)))


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: Mapping[str, Any] | None = None,
    ability: str | None = None,
) -> Score:
    """Score one response with the built-in reward for its data_source (float, or dict with "score")."""
    score = _route(data_source, ability)
    if ground_truth is None:  # possible only with data.require_ground_truth=false
        raise ArcherError(
            f"the built-in reward of data_source {data_source!r} compares with a ground truth, and this row has none",
            "give the row a reward_model.ground_truth, or score such rows with your own function "
            "(custom_reward_function.path=FILE)",
        )
    return score(solution_str, ground_truth)
