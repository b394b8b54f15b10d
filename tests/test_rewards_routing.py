"""Tests of archer.rewards.routing: routing rows to the built-in rewards."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from archer.data.parquet import read_rl_parquet
from archer.errors import ArcherError
from archer.rewards.routing import check_routes, default_compute_score, known_data_sources

QA_OK = "<think>t</think><answer>\\boxed{Eleanor Of Lancaster}</answer>"


@pytest.mark.parametrize(
    "source",
    [
        "openai/gsm8k",
        "lighteval/MATH",
        "DigitalLearningGmbH/MATH-lighteval",
        "HuggingFaceH4/MATH-500",
        "archer/arithmetic",
        "aime24",
        "aime25",
        "AIME2024",
        "math-ai/aime25",
    ],
)
def test_math_sources(source: str) -> None:
    assert default_compute_score(source, "so \\boxed{211}", "211") == 1.0
    assert default_compute_score(source, "so \\boxed{210}", "211") == 0.0


def test_dapo_math_is_plus_minus_one() -> None:
    assert default_compute_score("math_dapo", "\\boxed{211}", "211") == {"score": 1.0, "acc": 1.0}
    assert default_compute_score("math_dapo", "\\boxed{2}", "211") == {"score": -1.0, "acc": 0.0}


@pytest.mark.parametrize("source", ["countdown", "archer/countdown"])
def test_countdown_sources(source: str) -> None:
    gt = '{"target": 16, "numbers": [3, 5, 2]}'
    assert default_compute_score(source, "<answer>(3+5)*2</answer>", gt, ability="math") == {
        "score": 1.0,
        "acc": 1.0,
    }


def test_mixed_sources_route_by_ability() -> None:
    assert default_compute_score("DR_grpo_mix", "<answer>\\boxed{211}</answer>", "211", ability="math") == 1.0
    qa = default_compute_score(
        "DR_grpo_mix", QA_OK, "Eleanor Of Lancaster", extra_info={"index": 0}, ability="qa"
    )
    assert qa == {"score": 1.0, "acc": 1.0, "f1": 1.0, "format": 1.0, "both_tools": 0.0}
    assert default_compute_score("my_mix", "\\boxed{3}", "3", ability="Math") == 1.0


def test_deep_research_eval_sets_without_ability_use_qa() -> None:
    assert default_compute_score("DR_gaia", QA_OK, "eleanor of lancaster", ability="") == {
        "score": 1.0,
        "acc": 1.0,
        "f1": 1.0,
        "format": 1.0,
        "both_tools": 0.0,
    }


def test_unknown_source_names_the_known_ones_and_the_fix() -> None:
    with pytest.raises(ArcherError) as err:
        default_compute_score("my/dataset", "x", "y")
    message = str(err.value)
    assert "'my/dataset'" in message and "openai/gsm8k" in message and "archer/countdown" in message
    assert "custom_reward_function.path=FILE custom_reward_function.name=FN" in message


def test_unknown_ability() -> None:
    with pytest.raises(ArcherError, match="ability 'code'"):
        default_compute_score("my/dataset", "x", "y", ability="code")


def test_known_data_sources() -> None:
    sources = known_data_sources()
    assert sources == sorted(sources)
    assert {"openai/gsm8k", "math_dapo", "countdown", "archer/arithmetic", "archer/countdown"} <= set(sources)


def test_a_built_in_reward_refuses_a_row_without_ground_truth() -> None:
    # data.require_ground_truth=false lets such rows through for custom rewards; "None" is never an answer
    with pytest.raises(ArcherError, match="has none"):
        default_compute_score("openai/gsm8k", "\\boxed{None}", None)


@pytest.mark.parametrize("source", ["gsm8k", "math", "math500", "MATH500", "amc23"])
def test_arpo_math_benchmarks_route_to_math(source: str) -> None:
    assert default_compute_score(source, "so \\boxed{18}", "Janet sells 9 eggs... #### 18") == 1.0
    assert default_compute_score(source, "so \\boxed{17}", "18") == 0.0


@pytest.mark.parametrize("source", ["bamboogle", "hotpotqa", "2wiki", "musique", "gaia", "hle", "webwalker",
                                    "SimpleQA", "xbench", "nq", "searchR1_bamboogle", "searchR1_2wikimultihopqa"])
def test_arpo_qa_benchmarks_route_to_the_deep_research_reward(source: str) -> None:
    # the benchmarks' answer lists: F1 against the best reference (1.0 for an exact one); a malformed answer is -1
    qa = default_compute_score(source, QA_OK, ["Eleanor of Lancaster", "Eleanor"])
    assert qa["score"] == 1.0 and qa["f1"] == 1.0
    assert default_compute_score(source, "Eleanor", ["Eleanor"])["score"] == -1.0


def test_search_r1_prefix_routes_only_qa_names() -> None:
    with pytest.raises(ArcherError, match="no built-in reward for data_source 'searchR1_gsm8k'"):
        default_compute_score("searchR1_gsm8k", "\\boxed{1}", "1")


def test_check_routes_names_every_source_without_a_reward_and_the_routes() -> None:
    check_routes([("DR_grpo_mix", "math"), ("DR_grpo_mix", "qa"), ("bamboogle", ""), ("DR_gaia", ""),
                  ("archer/countdown", "")], "train.parquet")
    with pytest.raises(ArcherError) as info:
        check_routes([("bamboogle", ""), ("my_set", ""), ("other", None), ("mix", "code"), ("my_set", "")],
                     "data.train_files")
    message = str(info.value)
    assert message.startswith("data.train_files: no built-in reward for data_source 'mix' (ability 'code'), "
                              "'my_set', 'other'; known data sources: [")
    assert "'bamboogle'" in message and "'openai/gsm8k'" in message and "DR_* sources" in message
    assert "custom_reward_function.path=FILE" in info.value.fix


SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.mark.skipif(not (SHARED_DATA / "arpo").is_dir(), reason="shared ARPO data not present")
def test_every_source_of_arpos_data_and_benchmarks_has_a_route() -> None:
    files = sorted((SHARED_DATA / "arpo").glob("*.parquet"))
    assert len(files) == 5
    for path in files:
        check_routes(((r["data_source"], r["ability"]) for r in read_rl_parquet(path)), str(path))
    benchmarks = sorted(p.name for p in (SHARED_DATA / "benchmarks").iterdir())
    assert benchmarks == ["2wiki", "SimpleQA", "aime24", "gaia", "gsm8k", "hotpotqa", "math500", "webwalker"]
    # the benchmark names of ARPO's evaluation (evaluation/evaluate_passk.sh), the shared ones among them
    check_routes([(name, "") for name in [*benchmarks, "aime25", "math", "bamboogle", "musique", "hle", "xbench"]],
                 "ARPO's benchmarks")


def test_a_source_routed_only_by_its_ability_is_named_in_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="archer.rewards"):
        check_routes([("my_set", "math"), ("my_set", "Math"), ("DR_grpo_mix", "qa"), ("gsm8k", "math"),
                      ("archer/arithmetic", "math")], "data.train_files")
    assert [r.getMessage() for r in caplog.records] == [
        "data.train_files: data_source 'my_set' has no reward of its own; its rows are scored by the reward of their "
        "ability (math: the math reward, the last \\boxed{} answer checked with math-verify). Set "
        "custom_reward_function.path=FILE to score it otherwise"]  # ARPO's DR_* mixes route by ability, silently
