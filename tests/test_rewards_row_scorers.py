"""Tests of archer.rewards.row_scorers: verl's reward managers by name (naive, batch, dapo, prime), each with its
calling convention, on hand-computed cases."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import test_rewards_reward_stage as char_batches
import torch
from transformers import PreTrainedTokenizerFast

from archer.errors import ArcherError
from archer.rewards.reward_stage import RewardManager
from archer.rewards.row_scorers import REWARD_MANAGERS, check_manager
from archer.rewards.shaping import OverlongBuffer

tokenizer = char_batches.tokenizer  # the fixture: one token per character
make_batch = char_batches.make_batch


def test_the_registry_has_verls_managers() -> None:
    assert sorted(REWARD_MANAGERS) == ["batch", "dapo", "naive", "prime"]


def test_an_unknown_manager_is_an_error_listing_the_names(tokenizer: PreTrainedTokenizerFast) -> None:
    with pytest.raises(ArcherError, match="unknown reward manager 'wizard'") as info:
        RewardManager(tokenizer, manager="wizard")
    assert "reward_model.reward_manager" in info.value.fix and "batch, dapo, naive, prime" in info.value.fix


def test_naive_calls_the_function_once_per_row_with_keywords(tokenizer: PreTrainedTokenizerFast) -> None:
    calls = []

    def compute_score(*, data_source: str, solution_str: str, ground_truth: str, extra_info: Any) -> float:
        calls.append((data_source, solution_str, ground_truth, extra_info["index"]))
        return float(len(solution_str))

    batch = make_batch(tokenizer, ["ab", "abcd"], ["s1", "s2"], ["g1", "g2"])
    out = RewardManager(tokenizer, compute_score=compute_score, manager="naive")(batch)
    assert calls == [("s1", "ab", "g1", 0), ("s2", "abcd", "g2", 1)]
    np.testing.assert_array_equal(out.scores, [2.0, 4.0])


def test_naive_takes_no_reward_kwargs() -> None:
    with pytest.raises(ArcherError, match=r"reward_kwargs \['scale'\] are not arguments of reward_manager=naive; "
                                          "it takes none"):
        check_manager("naive", {"scale": 2}, has_custom_function=True)


def test_batch_calls_the_function_once_with_lists_and_the_reward_kwargs(tokenizer: PreTrainedTokenizerFast) -> None:
    calls = []

    def compute_batch(data_sources: list, solution_strs: list, ground_truths: list, extra_infos: list,
                      scale: float) -> list:
        calls.append((list(data_sources), list(solution_strs), list(ground_truths), [e["index"] for e in extra_infos]))
        return [scale * len(s) if s == g else {"score": -1.0, "acc": 0.0, "why": 7}
                for s, g in zip(solution_strs, ground_truths, strict=True)]

    batch = make_batch(tokenizer, ["abc", "x", "ab"], ["a", "b", "c"], ["abc", "y", "ab"])
    out = RewardManager(tokenizer, compute_score=compute_batch, manager="batch",
                        manager_kwargs={"scale": 0.5})(batch)
    assert calls == [(["a", "b", "c"], ["abc", "x", "ab"], ["abc", "y", "ab"], [0, 1, 2])]
    np.testing.assert_array_equal(out.scores, [1.5, -1.0, 1.0])
    np.testing.assert_array_equal(out.acc, [1.0, 0.0, 1.0])
    assert [dict(e) for e in out.extras] == [{}, {"why": 7}, {}]
    expected = torch.zeros(3, 48)
    expected[[0, 1, 2], [3, 1, 2]] = torch.tensor([1.5, -1.0, 1.0])  # each score on its row's eos
    torch.testing.assert_close(out.token_level_scores, expected)


def test_batch_needs_a_function_and_one_result_per_row(tokenizer: PreTrainedTokenizerFast) -> None:
    with pytest.raises(ArcherError, match="custom_reward_function.path is not set"):
        check_manager("batch", {}, has_custom_function=False)

    batch = make_batch(tokenizer, ["a", "b"], ["s", "s"], ["a", "b"])
    short = RewardManager(tokenizer, compute_score=lambda **kw: [1.0], manager="batch")
    with pytest.raises(ArcherError, match="returned 1 results for 2 rows"):
        short(batch)
    scalar = RewardManager(tokenizer, compute_score=lambda **kw: 1.0, manager="batch")
    with pytest.raises(ArcherError, match="returned 1.0 for 2 rows"):
        scalar(batch)

    def broken(**kw: Any) -> list:
        raise KeyError("gt")

    with pytest.raises(ArcherError, match="batch reward function failed on a batch of 2 rows: KeyError"):
        RewardManager(tokenizer, compute_score=broken, manager="batch")(batch)


def _ends_with_brace(data_source: str, solution_str: str, ground_truth: str, extra_info: Any) -> float:
    return 1.0 if solution_str.endswith("}") else 0.0


def test_dapo_cuts_the_eos_text_off_the_response(tokenizer: PreTrainedTokenizerFast) -> None:
    # "<eos>" written as plain characters survives decoding; DAPO's manager removes it before scoring
    batch = make_batch(tokenizer, ["\\boxed{7}<eos>", "\\boxed{7}"], ["s", "s"], ["7", "7"])
    naive = RewardManager(tokenizer, compute_score=_ends_with_brace, manager="naive")(batch)
    dapo = RewardManager(tokenizer, compute_score=_ends_with_brace, manager="dapo")(batch)
    np.testing.assert_array_equal(naive.scores, [0.0, 1.0])
    np.testing.assert_array_equal(dapo.scores, [1.0, 1.0])
    assert dapo.response_text[0] == "\\boxed{7}<eos>"  # the dumps keep what the model wrote


def test_dapo_overlong_buffer_from_verls_reward_kwargs(tokenizer: PreTrainedTokenizerFast) -> None:
    # responses of 10, 16, 18, 20 tokens (eos included); L_max 20, L_buf 5 -> penalties 0, -0.2, -0.6, -1.0
    texts = ["a" * (n - 1) for n in (10, 16, 18, 20)]
    batch = make_batch(tokenizer, texts, ["s"] * 4, ["x"] * 4)
    kwargs = {"overlong_buffer_cfg": {"enable": True, "len": 5, "penalty_factor": 1.0, "log": False},
              "max_resp_len": 20}
    out = RewardManager(tokenizer, compute_score=lambda **kw: 1.0, manager="dapo", manager_kwargs=kwargs,
                        max_response_length=999)(batch)
    np.testing.assert_allclose(out.overlong_penalty, [0.0, -0.2, -0.6, -1.0], atol=1e-12)
    np.testing.assert_allclose(out.scores, [1.0, 0.8, 0.4, 0.0], atol=1e-12)

    # max_resp_len defaults to data.max_response_length; a disabled buffer shapes nothing
    default = RewardManager(tokenizer, compute_score=lambda **kw: 1.0, manager="dapo",
                            manager_kwargs={"overlong_buffer_cfg": {"enable": True, "len": 5}},
                            max_response_length=20)(batch)
    np.testing.assert_allclose(default.scores, [1.0, 0.8, 0.4, 0.0], atol=1e-12)
    off = RewardManager(tokenizer, compute_score=lambda **kw: 1.0, manager="dapo",
                        manager_kwargs={"overlong_buffer_cfg": {"enable": False, "len": 5}})(batch)
    assert off.overlong_penalty is None and list(off.scores) == [1.0] * 4


def test_dapo_refuses_two_buffers_and_unknown_buffer_keys(tokenizer: PreTrainedTokenizerFast) -> None:
    kwargs = {"overlong_buffer_cfg": {"enable": True, "len": 5}, "max_resp_len": 20}
    with pytest.raises(ArcherError, match="two overlong buffers are set"):
        RewardManager(tokenizer, manager="dapo", manager_kwargs=kwargs, overlong=OverlongBuffer(20, 5, 1.0))
    with pytest.raises(ArcherError, match=r"overlong_buffer_cfg has unknown key\(s\) \['lenght'\]"):
        RewardManager(tokenizer, manager="dapo", manager_kwargs={"overlong_buffer_cfg": {"lenght": 5}})
    with pytest.raises(ArcherError, match="it takes only overlong_buffer_cfg, max_resp_len"):
        check_manager("dapo", {"max_len": 3}, has_custom_function=False)


def _prime_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any, /) -> Any:
    """Positional only, as verl's PRIME manager calls it; 'slow' hangs, 'boom' raises, 'pair' is a tuple."""
    if data_source == "slow":
        time.sleep(60)
    if data_source == "boom":
        raise ValueError("bad row")
    if data_source == "pair":
        return (0.25, "detail")
    return {"score": float(solution_str == ground_truth), "f1": 0.5}


def test_prime_scores_rows_in_processes_and_fails_closed(tokenizer: PreTrainedTokenizerFast) -> None:
    batch = make_batch(tokenizer, ["ab", "x", "ab", "ab", "c"], ["ok", "ok", "slow", "boom", "pair"],
                       ["ab", "ab", "ab", "ab", "c"])
    manager = RewardManager(tokenizer, compute_score=_prime_score, manager="prime",
                            manager_kwargs={"timeout": 3.0, "num_processes": 2})
    start = time.monotonic()
    out = manager(batch)
    assert time.monotonic() - start < 30  # the hung row is ended at the deadline, not waited for
    np.testing.assert_array_equal(out.scores, [1.0, 0.0, 0.0, 0.0, 0.25])
    assert [e.get("reward_failed") for e in out.extras] == [0.0, 0.0, 1.0, 1.0, 0.0]
    assert [e.get("f1") for e in out.extras] == [0.5, 0.5, None, None, None]


def test_prime_uses_the_built_in_routing_without_a_custom_function(tokenizer: PreTrainedTokenizerFast) -> None:
    batch = make_batch(tokenizer, ["\\boxed{64}", "\\boxed{65}"], ["archer/arithmetic"] * 2, ["64", "64"])
    out = RewardManager(tokenizer, manager="prime", manager_kwargs={"num_processes": 2})(batch)
    np.testing.assert_array_equal(out.scores, [1.0, 0.0])
    assert [dict(e) for e in out.extras] == [{"reward_failed": 0.0}] * 2


def test_prime_refuses_bad_settings() -> None:
    with pytest.raises(ArcherError, match="must be positive"):
        REWARD_MANAGERS["prime"](None, None, timeout=0)
    with pytest.raises(ArcherError, match="it takes only timeout, num_processes"):
        check_manager("prime", {"workers": 3}, has_custom_function=False)


def test_the_config_is_checked_before_any_model_loads() -> None:
    from archer.config.loader import load_config
    from archer.trainer.config_check import check_config

    base = ["data.train_files=x.parquet", "actor_rollout_ref.model.path=m"]
    with pytest.raises(ArcherError, match="reward_manager=batch calls your batch function"):
        check_config(load_config("ppo_trainer", [*base, "reward_model.reward_manager=batch"]))
    with pytest.raises(ArcherError, match="are not arguments of reward_manager=naive"):
        check_config(load_config("ppo_trainer", [*base, "+reward_model.reward_kwargs.scale=2"]))
    verl_dapo = ["reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
                 "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4", "+reward_model.reward_kwargs.max_resp_len=16"]
    check_config(load_config("ppo_trainer", [*base, *verl_dapo]))  # verl's DAPO overrides load as written


def test_prime_refuses_a_function_that_cannot_reach_a_worker_process(tokenizer: PreTrainedTokenizerFast) -> None:
    with pytest.raises(ArcherError, match="reward_manager=prime runs the reward function in worker processes"):
        RewardManager(tokenizer, compute_score=lambda *args: 1.0, manager="prime")
