"""The policy-version rules of every mode (archer/rollout/policy_versions.py), by hand."""

from __future__ import annotations

from archer.rollout.policy_versions import engine_version, oldest_trained_age, past_bound, version_age


def test_step_k_updates_the_version_the_engine_holds_the_previous_steps_weights() -> None:
    assert [engine_version(step) for step in (1, 2, 5)] == [0, 1, 4]  # version 0: the initial model


def test_a_groups_age_counts_from_its_first_token_and_the_bound_evicts_only_past_it() -> None:
    assert version_age(5, 3) == 2 and version_age(5, None) == 0  # no token yet: no age
    assert not past_bound(4, 3, 1)  # one version old, bound 1: kept
    assert past_bound(5, 3, 1)  # two versions old: past it
    assert not past_bound(9, None, 0)


def test_the_oldest_trained_age_is_the_warm_up_plus_the_engines_lag() -> None:
    assert oldest_trained_age(0, 0) == 0 and oldest_trained_age(2, 0) == 2  # colocate_async
    assert oldest_trained_age(0, 1) == 1 and oldest_trained_age(2, 1) == 3  # separate_async: one update behind
