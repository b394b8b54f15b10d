"""The multi-turn tool loop (archer/rollout/agentic.py) on a scripted engine: tokens and masks of model text and
tool answers, the call limit, the response budget, verl's answer cut, both call formats, and the output layout."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from agentic_support import Echo, ScriptedEngine, Turn, registry, tokenizer

from archer.rollout.agentic import AgenticRollout, LoopSettings
from archer.rollout.base import SamplingParams
from archer.rollout.call_formats import ArpoTags, HermesCalls
from archer.rollout.tool_text import clip_text, cut_ids, share_room

TOK = tokenizer()
EOS = TOK.eos_token_id
CALL = "<think>let me compute</think> <python>print(6 * 7)</python>"
ANSWER = " <answer>\\boxed{42}</answer>"


def enc(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def arpo_loop(script, *tools, budget: int = 200, call_limit: int = 3, **settings) -> AgenticRollout:
    reg = registry(*(tools or (Echo(answer="42"),)), call_limit=call_limit)
    return AgenticRollout(ScriptedEngine(script, TOK), TOK, reg, ArpoTags(reg),
                          LoopSettings(response_length=budget, call_limit=call_limit, **settings))


def run(loop: AgenticRollout, prompts=("What is six times seven?",), n: int = 1, seed: int = 0, branching=None):
    return loop.generate([enc(p) for p in prompts], SamplingParams(n=n, seed=seed, max_new_tokens=8), branching)


def present(out, row: int) -> list[int]:
    return out.responses[row, :int((out.response_mask[row] + out.tool_mask[row]).sum())].tolist()


def calls_then_answer(calls: int, call_text: str = CALL):
    def script(state, session):
        return Turn(call_text, entropy=1.0) if state.turns < calls else Turn(ANSWER, entropy=2.0, eos=True)
    return script


# -- tokens and masks --------------------------------------------------------------------------------------------
def test_tool_answers_are_context_and_model_tokens_are_learned():
    tool = Echo(answer="42")
    out = run(arpo_loop(calls_then_answer(1), tool))
    call, head, answer, tail, final = enc(CALL), enc(" <result>\n"), enc("42"), enc("\n</result>"), enc(ANSWER)
    expected = call + head + answer + tail + final + [EOS]
    learned = [1] * len(call) + [0] * len(head + answer + tail) + [1] * (len(final) + 1)
    assert out.responses[0].tolist() == expected  # ids as generated, the answer's pieces as encoded
    assert out.response_mask[0].tolist() == learned
    assert out.tool_mask[0].tolist() == [1 - m for m in learned]
    assert out.log_probs[0].tolist() == [-0.5 if m else 0.0 for m in learned]
    assert out.entropies[0].tolist() == [1.0] * len(call) + [0.0] * len(head + answer + tail) + [2.0] * (len(final) + 1)
    assert tool.calls == ["print(6 * 7)"]
    assert (out.finish_reasons, out.num_tool_calls, out.num_turns, out.branch_parent, out.branch_position) == (
        ["eos"], [1], [2], [-1], [-1])
    assert TOK.decode(expected, skip_special_tokens=True) == CALL + " <result>\n42\n</result>" + ANSWER


def test_the_engine_sees_the_sequence_exactly_as_laid_out():
    loop = arpo_loop(calls_then_answer(2))
    seen = []
    script = loop.engine.script

    def spy(state, session):
        seen.append(state.prompt + state.response)
        return script(state, session)

    loop.engine.script = spy
    out = run(loop)
    prompt = enc("What is six times seven?")
    full = prompt + present(out, 0)
    learned = out.response_mask[0].tolist()
    segment_starts = [0] + [i for i in range(1, len(full) - len(prompt)) if learned[i] and not learned[i - 1]]
    assert [s == full[:len(s)] for s in seen] == [True] * 3  # each turn continued the very same ids
    assert [len(s) - len(prompt) for s in seen] == segment_starts


def test_the_call_ends_at_the_first_closing_tag_even_inside_the_last_token():
    reg = registry(Echo(), Echo("search", trigger_tag="search"))
    tags = ArpoTags(reg)
    assert tags.stop_strings == ("</python>", "</search>")
    # an engine stops at the token that completes the tag; that token may carry more text
    (parsed,) = tags.parse("<python>print(1)</python>x", "stop")
    assert (parsed.call.tool, parsed.call.content, parsed.error) == ("python", "print(1)", None)
    (parsed,) = tags.parse("<search>a</search> <python>b</python>", "stop")
    assert (parsed.call.tool, parsed.call.content) == ("search", "a")
    assert tags.parse("<python>print(1)</python>", "eos") == [] and tags.parse("plain", "stop") == []


def test_a_closing_tag_without_its_opening_tag_is_answered_with_an_error():
    tool = Echo(answer="never")
    out = run(arpo_loop(calls_then_answer(1, "print(1)</python>"), tool))
    assert tool.calls == []
    text = TOK.decode(present(out, 0), skip_special_tokens=True)
    assert "<result>\nError: </python> without a <python> before it.\n</result>" in text
    assert out.num_tool_calls == [1] and out.stats.invalid_calls == 1 and out.stats.records == []


@pytest.mark.parametrize(("text", "eos", "budget"), [("<think>x</think> <python>print(1)", True, 200),
                                                     ("<python>print(6 * 7) and more", False, 12)])
def test_a_response_that_ends_inside_an_unclosed_call_counts_an_invalid_call(text, eos, budget):
    tool = Echo()
    out = run(arpo_loop(lambda s, _: Turn(text, eos=eos), tool, budget=budget))
    assert tool.calls == [] and out.tool_mask.sum() == 0  # nothing runs, nothing answers: the response ended
    assert out.finish_reasons == ["eos" if eos else "length"] and out.num_tool_calls == [0]
    assert out.stats.invalid_calls == 1 and out.stats.metrics()["tools/invalid_calls"] == 1.0
    assert out.stats.metrics()["tools/python/calls"] == 0.0 and out.stats.calls_per_response == [0]


def test_closed_calls_and_plain_text_leave_no_unclosed_call():
    tags = ArpoTags(registry(Echo(), Echo("search", trigger_tag="search")))
    assert tags.unclosed("<python>print(1)</python> <search>a")
    assert tags.unclosed("<search>a</search><python>b")
    assert not tags.unclosed("<python>print(1)</python> done") and not tags.unclosed("plain text")
    assert tags.unclosed('<python>print("</search>")')  # the last opening tag's own closing tag is missing
    out = run(arpo_loop(calls_then_answer(1)))
    assert out.stats.invalid_calls == 0 and out.finish_reasons == ["eos"]


def test_a_user_stop_string_ends_the_response_without_a_call():
    tool = Echo()
    loop = arpo_loop(lambda s, _: Turn("<answer>42</answer> more"), tool)
    out = loop.generate([enc("q")], SamplingParams(n=1, seed=0, stop=("</answer>",)), None)
    assert out.finish_reasons == ["stop"] and tool.calls == [] and out.tool_mask.sum() == 0


# -- call limit --------------------------------------------------------------------------------------------------
def test_a_call_beyond_call_limit_ends_the_response_with_a_learned_eos():
    tool = Echo(answer="42")
    out = run(arpo_loop(calls_then_answer(5), tool, call_limit=2))
    tokens, learned = present(out, 0), out.response_mask[0].tolist()
    assert tool.calls == ["print(6 * 7)"] * 2
    assert tokens[-1] == EOS and learned[len(tokens) - 1] == 1 and out.log_probs[0, len(tokens) - 1] == 0
    assert tokens[-1 - len(enc(CALL)):-1] == enc(CALL)  # the third call, unanswered, then the eos
    assert out.finish_reasons == ["call_limit"] and out.num_tool_calls == [2]
    assert out.stats.metrics()["tools/call_limit_reached"] == 1.0
    assert out.stats.metrics()["tools/python/calls"] == 2.0


def test_call_limit_zero_allows_no_call():
    out = run(arpo_loop(calls_then_answer(1), call_limit=0))
    assert out.finish_reasons == ["call_limit"] and out.tool_mask.sum() == 0 and present(out, 0)[-1] == EOS


# -- budget ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", range(8, 90, 3))
def test_a_response_never_passes_the_budget_nor_ends_on_tool_output(budget):
    out = run(arpo_loop(calls_then_answer(3), Echo(answer="0123456789 " * 4), budget=budget))
    length = len(present(out, 0))
    assert length <= budget
    assert out.response_mask[0, length - 1] == 1  # the last token is the model's
    assert out.responses.shape[1] == length


def test_an_answer_too_long_for_the_budget_is_cut_to_leave_the_model_one_token():
    call, frame = enc(CALL), enc(" <result>\n") + enc("\n</result>")
    long_answer = "abcdefghijklmnopqrstuvwxyz" * 3
    room = 10
    budget = len(call) + len(frame) + room + 1
    for side in ("left", "right", "middle"):
        out = run(arpo_loop(calls_then_answer(1), Echo(answer=long_answer), budget=budget,
                            tool_response_truncate_side=side))
        tokens = present(out, 0)
        assert len(tokens) == budget and out.finish_reasons == ["length"]
        answer = tokens[len(call) + len(enc(" <result>\n")):-1 - len(enc("\n</result>"))]
        assert answer == cut_ids(enc(long_answer), room, side)
        assert out.response_mask[0].tolist() == [1] * len(call) + [0] * (len(frame) + room) + [1]


def test_a_call_whose_empty_answer_would_not_fit_ends_the_response_unanswered():
    tool = Echo(answer="42")
    budget = len(enc(CALL)) + len(enc(" <result>\n") + enc("\n</result>"))
    out = run(arpo_loop(calls_then_answer(1), tool, budget=budget))
    assert tool.calls == [] and out.finish_reasons == ["length"]
    assert present(out, 0) == enc(CALL) and out.tool_mask.sum() == 0


@pytest.mark.parametrize(("side", "expected"), [("left", "abcd...(truncated)"), ("right", "(truncated)...ghij"),
                                                ("middle", "ab...(truncated)...ij")])
def test_max_tool_response_length_cuts_each_answer_on_its_side(side, expected):
    assert clip_text("abcdefghij", 4, side) == expected
    assert clip_text("abc", 4, side) == "abc" and clip_text("abcdefghij", None, side) == "abcdefghij"
    out = run(arpo_loop(calls_then_answer(1), Echo(answer="abcdefghij"), max_tool_response_length=4,
                        tool_response_truncate_side=side))
    assert f"<result>\n{expected}\n</result>" in TOK.decode(present(out, 0), skip_special_tokens=True)


def test_token_cuts_and_the_shares_of_a_turns_answers():
    assert cut_ids([1, 2, 3, 4, 5], 3, "left") == [1, 2, 3]
    assert cut_ids([1, 2, 3, 4, 5], 3, "right") == [3, 4, 5]
    assert cut_ids([1, 2, 3, 4, 5], 3, "middle") == [1, 4, 5]
    assert cut_ids([1, 2], 3, "middle") == [1, 2] and cut_ids([1, 2], 0, "right") == []
    # sorted by length 2, 7, 10: 2 keeps 2 (share 4), 7 keeps 5 (share 10 // 2), 10 keeps the last 5
    assert share_room([10, 2, 7], 12) == [5, 2, 5]
    assert share_room([3, 3], 100) == [3, 3] and share_room([4], -2) == [0]


# -- hermes --------------------------------------------------------------------------------------------------------
def hermes_call(name: str = "python", arguments=None) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments or {"code": "print(1)"}}) + "\n</tool_call>"


def hermes_loop(script, *tools, chat_template: str | None = None, budget: int = 300) -> AgenticRollout:
    reg = registry(*(tools or (Echo(),)), call_limit=4)
    return AgenticRollout(ScriptedEngine(script, TOK), TOK, reg, HermesCalls(TOK, chat_template=chat_template),
                          LoopSettings(response_length=budget, call_limit=4))


def test_hermes_calls_run_and_their_answers_are_the_chat_templates_tool_turn():
    tool = Echo()

    def script(state, session):
        return Turn(hermes_call(), eos=True) if state.turns == 0 else Turn("done", eos=True)

    prompt_text = TOK.apply_chat_template([{"role": "user", "content": "q"}], tokenize=False, add_generation_prompt=True)
    out = hermes_loop(script, tool).generate([enc(prompt_text)], SamplingParams(n=1, seed=0), None)
    assert tool.calls == ["print(1)"]
    conversation = TOK.apply_chat_template(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": hermes_call()},
         {"role": "tool", "content": ")1(tnirp"}, {"role": "assistant", "content": "done"}], tokenize=False)
    assert prompt_text + TOK.decode(present(out, 0)) == conversation.rstrip("\n")  # the template's text, bar the last \n
    tokens, tool_mask = present(out, 0), out.tool_mask[0].tolist()
    turn = enc("\n") + enc("<|im_start|>tool\n") + enc(")1(tnirp") + enc("<|im_end|>\n<|im_start|>assistant\n")
    first = enc(hermes_call()) + [EOS]
    assert tokens == first + turn + enc("done") + [EOS]
    assert tool_mask[:len(tokens)] == [0] * len(first) + [1] * len(turn) + [0] * (len(enc("done")) + 1)
    assert out.finish_reasons == ["eos"] and out.num_turns == [2]


# A Qwen2.5-like template written for this test: consecutive tool messages share one user turn.
GROUPING_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_hermes_runs_every_call_of_a_turn_and_answers_unreadable_ones():
    tool = Echo()
    calls = [hermes_call(arguments={"code": "a"}), "<tool_call>{not json</tool_call>",
             hermes_call("nope", {"q": "x"}), hermes_call(arguments={"code": "b", "timeout": 3})]

    def script(state, session):
        return Turn(" ".join(calls), eos=True) if state.turns == 0 else Turn("done", eos=True)

    loop = hermes_loop(script, tool, chat_template=GROUPING_TEMPLATE, budget=600)
    out = loop.generate([enc("q")], SamplingParams(n=1, seed=0), None)
    assert tool.calls == ["a", '{"code": "b", "timeout": 3}']  # one argument: its value; several: the JSON
    text = TOK.decode(present(out, 0))
    answers = text[text.index("<|im_end|>") + len("<|im_end|>"):text.rindex("done")]
    assert answers.startswith("\n<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nError: "
                              "the tool call is not valid JSON")
    assert "Error: there is no tool named 'nope' (tools: python)." in answers
    assert answers.endswith("\n<tool_response>\n}3 :\"tuoemit\" ,\"b\" :\"edoc\"{\n</tool_response><|im_end|>\n"
                            "<|im_start|>assistant\n")
    assert out.num_tool_calls == [4] and out.stats.invalid_calls == 2
    assert out.stats.metrics()["tools/python/calls"] == 2.0 and "tools/nope/calls" not in out.stats.metrics()


HOSTILE_CALLS = {
    "huge integer": '<tool_call>{"name": "python", "arguments": {"code": ' + "9" * 5000 + "}}</tool_call>",
    "huge integer name": '<tool_call>{"name": ' + "1" * 4301 + "}</tool_call>",
    "deep arguments": '<tool_call>{"name": "python", "arguments": ' + "[" * 5000 + "]" * 5000 + "}</tool_call>",
}


@pytest.mark.parametrize("hostile", HOSTILE_CALLS)
def test_a_hostile_hermes_call_is_an_invalid_call_of_its_own_trajectory_only(hostile: str):
    # json.loads raises ValueError past 4300 digits and RecursionError past the stack: neither may stop the batch
    tool = Echo()

    def script(state, session):
        if state.turns:
            return Turn("done", eos=True)
        bad = "bad" in session.text(state.prompt)
        return Turn(HOSTILE_CALLS[hostile] if bad else hermes_call(arguments={"code": "ok"}), eos=True)

    loop = hermes_loop(script, tool, budget=20_000)
    out = loop.generate([enc("bad q"), enc("good q")], SamplingParams(n=1, seed=0), None)
    assert tool.calls == ["ok"]  # the good trajectory's call ran; the hostile one ran nothing
    bad, good = TOK.decode(present(out, 0)), TOK.decode(present(out, 1))
    reason = "is nested too deeply" if hostile == "deep arguments" else "cannot be read (Exceeds the limit (4300 digits)"
    assert f"<|im_start|>tool\nError: the tool call's JSON {reason}" in bad and bad.endswith("done<|im_end|>")
    assert "<|im_start|>tool\nko<|im_end|>" in good
    assert out.finish_reasons == ["eos", "eos"] and out.num_tool_calls == [1, 1] and out.stats.invalid_calls == 1


def test_lone_surrogates_of_a_hermes_call_reach_neither_the_tool_nor_the_tokenizer_raw():
    tool = Echo()
    calls = hermes_call(arguments={"code": "a\ud800b"}) + hermes_call(name="\udfff")  # json.dumps escapes them

    def script(state, session):
        return Turn(calls, eos=True) if state.turns == 0 else Turn("done", eos=True)

    out = hermes_loop(script, tool, budget=600).generate([enc("q")], SamplingParams(n=1, seed=0), None)
    assert tool.calls == ["a\ufffdb"]
    text = TOK.decode(present(out, 0))
    assert "b\ufffda" in text and "Error: there is no tool named '\ufffd' (tools: python)." in text


def test_hermes_call_beyond_the_limit_ends_on_the_turns_own_eos():
    reg = registry(Echo(), call_limit=0)
    loop = AgenticRollout(ScriptedEngine(lambda s, _: Turn(hermes_call(), eos=True), TOK), TOK, reg, HermesCalls(TOK),
                          LoopSettings(response_length=300, call_limit=0))
    out = loop.generate([enc("q")], SamplingParams(n=1, seed=0), None)
    assert present(out, 0) == enc(hermes_call()) + [EOS]  # no second eos
    assert out.finish_reasons == ["call_limit"] and out.stats.limit_reached == [True]


def test_the_tool_turn_follows_the_special_token_that_closes_the_turn_whatever_the_eos_token():
    base = copy.deepcopy(TOK)
    base.eos_token = "<|endoftext|>"  # a base model's eos; the chat template still closes turns with <|im_end|>
    for tok in (TOK, base):
        assert HermesCalls(tok).frame(1) == ["\n<|im_start|>tool\n", "<|im_end|>\n<|im_start|>assistant\n"]


def test_a_hermes_turn_that_ends_inside_an_unclosed_tool_call_counts_an_invalid_call():
    tool = Echo()
    text = hermes_call(arguments={"code": "a"}) + ' <tool_call>\n{"name": "python", "arguments": {"code": "b'
    assert HermesCalls(TOK).unclosed(text) and not HermesCalls(TOK).unclosed(hermes_call())
    out = hermes_loop(lambda s, _: Turn('<tool_call>\n{"name": "python"', eos=True), tool).generate(
        [enc("q")], SamplingParams(n=1, seed=0), None)
    assert tool.calls == [] and out.tool_mask.sum() == 0 and out.finish_reasons == ["eos"]
    assert out.num_tool_calls == [0] and out.stats.metrics()["tools/invalid_calls"] == 1.0


def test_an_unclosed_tool_call_after_a_hermes_turns_closed_calls_counts_an_invalid_call():
    tool = Echo()
    closed = hermes_call(arguments={"code": "ab"}) + " " + hermes_call(arguments={"code": "cd"})

    def answers(turn: str):
        def script(state, session):
            return Turn(turn, eos=True) if state.turns == 0 else Turn("done", eos=True)
        out = hermes_loop(script, tool, chat_template=GROUPING_TEMPLATE, budget=600).generate(
            [enc("q")], SamplingParams(n=1, seed=0), None)
        text = TOK.decode(present(out, 0))
        return out, text[text.index("<|im_end|>"):]

    out, tail = answers(closed + ' <tool_call>\n{"name": "python", "arguments": {"code": "ef')
    assert tool.calls == ["ab", "cd"]  # the closed calls run and are answered, the unclosed one is not
    assert tail == ("<|im_end|>\n<|im_start|>user\n<tool_response>\nba\n</tool_response>\n<tool_response>\ndc\n"
                    "</tool_response><|im_end|>\n<|im_start|>assistant\ndone<|im_end|>")
    assert out.num_tool_calls == [2] and out.num_turns == [2] and out.finish_reasons == ["eos"]
    metrics = out.stats.metrics()
    assert metrics["tools/invalid_calls"] == 1.0 and metrics["tools/python/calls"] == 2.0
    out, same_tail = answers(closed)  # the closed calls alone: answered alike, nothing invalid
    assert same_tail == tail and out.stats.invalid_calls == 0 and tool.calls == ["ab", "cd"] * 2


def test_an_arpo_call_whose_code_holds_another_tools_opening_tag_is_valid():
    tool = Echo(answer="ok")
    out = run(arpo_loop(calls_then_answer(1, '<python>print("<search>")</python>'), tool,
                        Echo("search", trigger_tag="search")))
    assert tool.calls == ['print("<search>")'] and out.num_tool_calls == [1] and out.stats.invalid_calls == 0


def test_hermes_turn_without_a_call_ends_the_response():
    out = hermes_loop(lambda s, _: Turn("no tools", eos=True)).generate([enc("q")], SamplingParams(n=2, seed=0), None)
    assert out.finish_reasons == ["eos", "eos"] and out.tool_mask.sum() == 0 and out.num_tool_calls == [0, 0]


# -- output -------------------------------------------------------------------------------------------------------
def test_rows_are_prompt_major_and_padded_after_the_end():
    def script(state, session):
        long = session.text(state.prompt).startswith("long")
        return Turn("a b c d e f g" if long else "a", eos=True)

    out = run(arpo_loop(script), prompts=("short", "long"), n=2)
    short, long = len(enc("a")) + 1, len(enc("a b c d e f g")) + 1
    assert out.responses.shape == (4, long)
    assert [len(present(out, r)) for r in range(4)] == [short, short, long, long]
    assert out.responses[0, short:].tolist() == [TOK.pad_token_id] * (long - short)
    assert out.response_mask[0, short:].sum() == 0 and out.tool_mask.sum() == 0
    assert out.stats.initial_rollouts == [2, 2] and out.stats.calls_per_response == [0, 0, 0, 0]


def test_the_loop_needs_a_seed():
    with pytest.raises(ValueError, match="seed"):
        arpo_loop(calls_then_answer(0)).generate([enc("q")], SamplingParams(n=1), None)


def test_segment_entropies_and_log_probs_keep_their_float_values():
    out = run(arpo_loop(calls_then_answer(0)))
    assert out.log_probs.dtype == torch.float32 and out.entropies.dtype == torch.float32


# -- per-row tools (the data's ``tools``) ---------------------------------------------------------------------
SEARCH_CALL = "<think>look it up</think> <search>six times seven</search>"


def test_a_prompt_runs_only_the_tools_its_row_allows():
    python, search = Echo(answer="42"), Echo("search", trigger_tag="search", answer="Page 1: 42")

    def script(state, session):
        if state.turns == 0:
            return Turn(CALL)
        return Turn(SEARCH_CALL) if state.turns == 1 else Turn(ANSWER, eos=True)

    loop = arpo_loop(script, python, search)
    prompts = ["What is six times seven?", "Who wrote it?", "The answer is here."]
    out = loop.generate([enc(p) for p in prompts], SamplingParams(n=1, seed=0, max_new_tokens=8), None,
                        allowed_tools=[["search"], None, []])
    texts = [TOK.decode(present(out, row), skip_special_tokens=True) for row in range(3)]
    refused_python = "<result>\nError: the tool 'python' is not available for this question (its tools: search)."
    assert refused_python in texts[0] and "<result>\nPage 1: 42\n</result>" in texts[0]
    assert "<result>\n42\n</result>" in texts[1] and "<result>\nPage 1: 42\n</result>" in texts[1]
    assert "(its tools: none).\n</result>" in texts[2] and texts[2].count("is not available") == 2
    assert python.calls == ["print(6 * 7)"] and search.calls == ["six times seven"] * 2  # only the allowed ran
    assert out.num_tool_calls == [2, 2, 2]  # refused calls are answered and count toward call_limit
    assert out.stats.invalid_calls == 3 and out.stats.disallowed_calls == 3
    metrics = out.stats.metrics()
    assert metrics["tools/disallowed_calls"] == 3.0 and metrics["tools/invalid_calls"] == 3.0
    assert metrics["tools/python/calls"] == 1.0 and metrics["tools/search/calls"] == 2.0


def test_allowed_tools_need_one_entry_per_prompt():
    with pytest.raises(ValueError, match="allowed_tools has 2 entries for 1 prompts"):
        arpo_loop(calls_then_answer(0)).generate([enc("x")], SamplingParams(n=1, seed=0), None, [None, None])
