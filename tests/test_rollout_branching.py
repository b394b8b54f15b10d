"""ARPO's branching and AEPO's rollout half in the agentic loop (scripted engine): exactly n responses per prompt,
shared prefixes, the entropy rule, refills, determinism under a seed, no state across calls, AEPO's global
samples and its penalty on consecutive branches; the rules against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch
from agentic_support import Echo, ScriptedEngine, Turn, registry, tokenizer

from archer.rollout.agentic import AgenticRollout, LoopSettings
from archer.rollout.base import SamplingParams
from archer.rollout.branching import BranchSettings, branch_probability, global_samples, segment_entropy
from archer.rollout.call_formats import ArpoTags

TOK = tokenizer()
LN_V = math.log(len(TOK))
PROMPTS = ["What is six times seven?", "Who wrote it?", "The answer is here."]


def enc(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def tool_script(calls: int = 3, first: float = 1.0, after_tool: float = 1.0, random_text: bool = False):
    """``calls`` tool calls, then an answer; entropy ``first`` on the first segment, ``after_tool`` after."""
    def script(state, session):
        entropy = first if state.turns == 0 else after_tool
        word = str(state.rng.randrange(10**6)) if random_text else "x"
        if state.turns < calls:
            return Turn(f"<think>{word}</think> <python>print({state.turns})</python>", entropy)
        return Turn(f" <answer>{word}</answer>", entropy, eos=True)
    return script


def make_loop(script, call_limit: int = 3) -> AgenticRollout:
    reg = registry(Echo(answer="7"), call_limit=call_limit)
    return AgenticRollout(ScriptedEngine(script, TOK), TOK, reg, ArpoTags(reg),
                          LoopSettings(response_length=400, call_limit=call_limit))


def generate(loop, settings: BranchSettings, prompts=PROMPTS, seed: int = 0):
    return loop.generate([enc(p) for p in prompts], SamplingParams(n=settings.n, seed=seed), settings)


def rows(out, prompt: int, n: int) -> range:
    return range(prompt * n, prompt * n + n)


def tokens(out, row: int) -> list[int]:
    return out.responses[row, :int((out.response_mask[row] + out.tool_mask[row]).sum())].tolist()


# -- the rules ------------------------------------------------------------------------------------------------
def test_segment_entropy_is_the_window_mean_over_ln_v():
    entropies = torch.tensor([1.0, 2.0, 3.0, 100.0])
    assert segment_entropy(entropies, 3, 100) == pytest.approx(2.0 / math.log(100))
    assert segment_entropy(entropies, 20, 100) == pytest.approx(26.5 / math.log(100))
    assert segment_entropy(torch.zeros(0), 20, 100) == 0.0


def test_branch_probability_follows_arpo_and_aepos_penalty():
    arpo = BranchSettings(n=4, initial_rollouts=2, beam_size=2, branch_probability=0.5, entropy_weight=0.2)
    assert branch_probability(arpo, 0.5, consecutive=3) == pytest.approx(0.6)  # no penalty without AEPO
    assert branch_probability(arpo, -3.0, 0) == 0.0 and branch_probability(arpo, 3.0, 0) == 1.0
    aepo = BranchSettings(n=4, initial_rollouts=2, beam_size=2, consecutive_branch_penalty=0.05)
    assert branch_probability(aepo, 0.5, consecutive=0) == pytest.approx(0.6)
    assert branch_probability(aepo, 0.5, consecutive=4) == pytest.approx(0.6 * 0.8)
    assert branch_probability(aepo, 0.5, consecutive=30) == 0.0


def test_aepos_global_samples_by_hand():
    # 16 * sigmoid(0.5 * 0.2) = 16 * 0.52498 = 8.4 -> 8, + 1
    assert global_samples(16, 0.3, 0.1, 0.5) == 9
    assert global_samples(16, 0.0, 0.0, 0.5) == 9
    assert global_samples(16, 0.0, 40.0, 0.5) == 1 and global_samples(16, 40.0, 0.0, 0.5) == 16


# -- counts and shapes ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("initial", "beam", "probability"), [(4, 1, 0.5), (1, 2, 1.0), (2, 2, 0.5), (1, 4, 0.3),
                                                               (1, 1, 0.5), (3, 3, 0.0)])
def test_every_prompt_ends_with_exactly_n_responses(initial, beam, probability):
    n = 4
    settings = BranchSettings(n=n, initial_rollouts=initial, beam_size=beam, branch_probability=probability,
                              entropy_weight=0.0)
    out = generate(make_loop(tool_script()), settings)
    assert len(out.responses) == len(PROMPTS) * n
    assert out.stats.initial_rollouts == [initial] * len(PROMPTS)
    for p in range(len(PROMPTS)):
        parents = [out.branch_parent[r] for r in rows(out, p, n)]
        assert parents[:initial] == [-1] * initial  # global samples first
        assert all(-1 <= parent < i for i, parent in enumerate(parents))
        assert all(out.finish_reasons[r] == "eos" for r in rows(out, p, n))
    branches = sum(parent >= 0 for parent in out.branch_parent)
    assert out.stats.metrics()["rollout/branches"] == branches
    assert out.stats.refills + branches == len(PROMPTS) * (n - initial)


def test_a_certain_branch_copies_the_trajectory_right_after_the_tool_answer():
    n = 3
    settings = BranchSettings(n=n, initial_rollouts=1, beam_size=3, branch_probability=1.0, entropy_weight=0.0)
    out = generate(make_loop(tool_script(random_text=True)), settings, prompts=PROMPTS[:1])
    assert out.branch_parent == [-1, 0, 0]  # two branches at the first answer: beam_size - 1 = 2 = the free slots
    tool = out.tool_mask[0].tolist()
    first_answer_end = tool.index(0, tool.index(1))  # the first model token after the first tool answer
    assert out.tool_mask[0, first_answer_end - 1] == 1 and out.response_mask[0, first_answer_end] == 1
    assert out.branch_position == [-1, first_answer_end, first_answer_end]  # the first token after the answer
    for child in (1, 2):
        assert tokens(out, child)[:first_answer_end] == tokens(out, 0)[:first_answer_end]
        assert out.response_mask[child, :first_answer_end].tolist() == out.response_mask[0, :first_answer_end].tolist()
        assert tokens(out, child)[first_answer_end:] != tokens(out, 0)[first_answer_end:]  # own seeds from there
        assert out.num_tool_calls[child] == 3  # one inherited, two of its own
    assert out.num_turns == [4, 4, 4]
    metrics = out.stats.metrics()
    assert metrics["rollout/branch_depth_mean"] == pytest.approx(2 / 3)
    assert metrics["rollout/branch_entropy_mean"] == pytest.approx(1.0 / LN_V)
    assert metrics["rollout/branch_entropy_delta_mean"] == pytest.approx(0.0)


def test_without_branches_the_missing_samples_are_refilled_one_at_a_time():
    n = 3
    settings = BranchSettings(n=n, initial_rollouts=1, beam_size=2, branch_probability=0.0, entropy_weight=0.0)
    loop = make_loop(tool_script(calls=1))
    out = generate(loop, settings, prompts=PROMPTS[:1])
    assert out.branch_parent == [-1, -1, -1] and out.stats.refills == 2
    # each refill starts once the previous sample has ended: never two of the prompt's samples in a round
    decode_calls = loop.engine.sessions[-1].decode_calls
    assert [len(c) for c in decode_calls] == [1] * 6
    metrics = out.stats.metrics()
    assert metrics["rollout/refills"] == 2.0 and metrics["rollout/branches"] == 0.0
    assert "rollout/branch_entropy_mean" not in metrics


@pytest.mark.parametrize(("after_tool", "branches"), [(3.0, 2), (0.1, 0)])
def test_a_rise_in_entropy_after_a_tool_answer_makes_the_branch(after_tool, branches):
    # P = clip(0 + 100 * dH, 0, 1): 1 when the entropy rises after the answer, 0 when it falls
    settings = BranchSettings(n=3, initial_rollouts=1, beam_size=2, branch_probability=0.0, entropy_weight=100.0)
    out = generate(make_loop(tool_script(first=1.0, after_tool=after_tool)), settings, prompts=PROMPTS[:1])
    assert sum(p >= 0 for p in out.branch_parent) == branches
    if branches:
        assert out.stats.metrics()["rollout/branch_entropy_delta_mean"] == pytest.approx((after_tool - 1.0) / LN_V)


# -- determinism ---------------------------------------------------------------------------------------------------
SETTINGS = BranchSettings(n=4, initial_rollouts=2, beam_size=2, branch_probability=0.5, entropy_weight=0.2)


def fingerprint(out) -> tuple:
    return (out.responses.tolist(), out.response_mask.tolist(), out.branch_parent, out.num_tool_calls)


def test_the_same_seed_gives_the_same_responses_and_branches():
    script = tool_script(random_text=True)
    first = generate(make_loop(script), SETTINGS, seed=5)
    assert fingerprint(generate(make_loop(script), SETTINGS, seed=5)) == fingerprint(first)
    assert fingerprint(generate(make_loop(script), SETTINGS, seed=6)) != fingerprint(first)


def test_no_state_outlives_a_call():
    # ARPO keeps the initial entropy of rollout slot i across calls: a second batch compared its entropies with
    # the first batch's. Here a call gives the same result whatever ran before it on the same loop.
    settings = BranchSettings(n=4, initial_rollouts=1, beam_size=2, branch_probability=0.0, entropy_weight=100.0)
    rising = tool_script(first=1.0, after_tool=2.0)
    alone = generate(make_loop(rising), settings, seed=1)
    loop = make_loop(tool_script(first=9.0, after_tool=9.0))
    generate(loop, settings, seed=1)  # an earlier batch with a high first-segment entropy
    loop.engine.script = rising
    assert fingerprint(generate(loop, settings, seed=1)) == fingerprint(alone)
    assert sum(p >= 0 for p in alone.branch_parent) > 0


# -- AEPO ----------------------------------------------------------------------------------------------------------
def test_dynamic_rollouts_split_n_by_each_prompts_entropy_gap():
    def script(state, session):
        calm = session.text(state.prompt).startswith("calm")
        first, later = (0.0, 40.0) if calm else (40.0, 0.0)
        return tool_script(calls=1, first=first, after_tool=later)(state, session)

    n = 8
    settings = BranchSettings(n=n, initial_rollouts=n, beam_size=2, branch_probability=0.5, entropy_weight=0.0,
                              dynamic_rollouts=True, dynamic_rollout_beta=0.5)
    loop = make_loop(script)
    out = generate(loop, settings, prompts=["calm question", "open question"])
    gap = 40.0 / LN_V
    expected = [global_samples(n, 0.0, gap, 0.5), global_samples(n, gap, 0.0, 0.5)]
    assert expected == [int(n / (1 + math.exp(0.5 * gap))) + 1, int(n / (1 + math.exp(-0.5 * gap))) + 1]
    assert out.stats.initial_rollouts == expected and expected[0] < expected[1]
    assert len(out.responses) == 2 * n
    probe, main = loop.engine.sessions
    assert probe.next_id == 2  # one probe trajectory per prompt, in its own session
    assert [out.branch_parent[i] for i in range(expected[0])] == [-1] * expected[0]


def test_the_probes_tool_calls_count_in_the_tool_metrics_but_not_per_response():
    def script(state, session):  # prompt "good" calls the tool, "bad" writes a closing tag alone (invalid)
        call = "<python>print(1)</python>" if session.text(state.prompt) == "good" else "print(1)</python>"
        return Turn(call) if state.turns == 0 else Turn(" <answer>1</answer>", eos=True)

    n = 4
    settings = BranchSettings(n=n, initial_rollouts=n, dynamic_rollouts=True)  # beam_size 1: no branches
    out = generate(make_loop(script), settings, prompts=["good", "bad"])
    assert out.num_tool_calls == [1] * 2 * n  # every response made its one call
    # n responses of each prompt plus its probe: n + 1 calls run for "good", n + 1 invalid calls for "bad"
    assert len(out.stats.records) == n + 1 and out.stats.invalid_calls == n + 1
    metrics = out.stats.metrics()
    assert metrics["tools/python/calls"] == n + 1 and metrics["tools/invalid_calls"] == n + 1
    assert out.stats.calls_per_response == [1] * 2 * n and metrics["tools/calls_per_response"] == 1.0
    assert out.stats.limit_reached == [False] * 2 * n and out.stats.turns == [2] * 2 * n


def test_the_consecutive_branch_penalty_skips_the_point_after_a_branch():
    def parents(penalty: float) -> list[int]:
        settings = BranchSettings(n=8, initial_rollouts=1, beam_size=2, branch_probability=1.0, entropy_weight=0.0,
                                  consecutive_branch_penalty=penalty)
        return generate(make_loop(tool_script(calls=3)), settings, prompts=PROMPTS[:1]).branch_parent

    # Each trajectory makes 3 calls; a decision at an answer comes once the next segment is written. Without the
    # penalty every point with a free slot branches: 0 at its answers 1, 2, 3 (children 1, 2, 3), 1 at its answers
    # 2, 3 (children 4, 5), 2 at its answer 3 (child 6), 4 at its answer 3 (child 7).
    assert parents(0.0) == [-1, 0, 0, 0, 1, 1, 2, 4]
    # With penalty 1 a path that branched at its last point cannot branch at the next: 0 branches at answers 1 and
    # 3 (children 1, 2); 1 (born of a branch at answer 1) skips answer 2 and branches at 3 (child 3). No path is
    # active then, so a refill (4) starts, and the same pattern gives children 5, 6 of 4 and 7 of 5.
    assert parents(1.0) == [-1, 0, 0, 1, -1, 4, 4, 5]
