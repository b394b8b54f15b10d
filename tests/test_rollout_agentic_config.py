"""The agentic keys of actor_rollout_ref.rollout: defaults (plain independent samples, ARPO's tags), the checks
that name a bad key before anything loads, the settings a training or validation rollout gets, and the rollout
worker's layout of the loop's output (tool output: attention 1, response_mask 0, tool_mask 1)."""

from __future__ import annotations

import pytest
import torch
from agentic_support import ScriptedEngine, Turn, tokenizer

from archer.batch import Batch, response_attention
from archer.config.loader import load_config
from archer.errors import ArcherError
from archer.rollout.agentic_config import (
    branch_settings,
    check_agentic_config,
    check_row_tools,
    loop_settings,
    uses_tools,
)
from archer.rollout.base import SamplingParams
from archer.rollout.branching import BranchSettings
from archer.trainer.config_check import check_config
from archer.workers.results import ROLLOUT_STATS
from archer.workers.rollout import RolloutWorker, sampling_params

ROLLOUT = "actor_rollout_ref.rollout"
REQUIRED = ["actor_rollout_ref.model.path=/no/model", "data.train_files=/no/train.parquet"]
ECHO = [f"+{ROLLOUT}.tools.tool_instances.python.class_path=agentic_support.Echo",
        f"+{ROLLOUT}.tools.tool_instances.python.params.answer='7'"]


def rollout_cfg(*overrides: str):
    return load_config("ppo_trainer", [*REQUIRED, *overrides]).actor_rollout_ref.rollout


def test_defaults_are_independent_samples_with_arpos_tags():
    cfg = rollout_cfg()
    assert not uses_tools(cfg)
    check_agentic_config(cfg)
    assert loop_settings(cfg) == loop_settings(rollout_cfg("data.max_response_length=512"))
    settings = loop_settings(cfg)
    assert (settings.response_length, settings.call_limit, settings.max_tool_response_length,
            settings.tool_response_truncate_side, settings.entropy_window) == (512, 3, None, "middle", 20)
    assert cfg.multi_turn.format == "arpo"
    train = branch_settings(cfg, SamplingParams(n=1, seed=0), validate=False)
    assert train == BranchSettings(n=1, initial_rollouts=1, beam_size=1, branch_probability=0.5, entropy_weight=0.2)


def test_training_branches_and_validation_and_greedy_do_not():
    cfg = rollout_cfg(*ECHO, f"{ROLLOUT}.n=16", f"{ROLLOUT}.initial_rollouts=8", f"{ROLLOUT}.beam_size=2",
                      f"{ROLLOUT}.enable_dynamic_rollouts=true", f"{ROLLOUT}.consecutive_branch_penalty=0.05")
    sample = SamplingParams(n=16, seed=0)
    settings = branch_settings(cfg, sample, validate=False)
    assert settings == BranchSettings(n=16, initial_rollouts=8, beam_size=2, branch_probability=0.5,
                                      entropy_weight=0.2, dynamic_rollouts=True, dynamic_rollout_beta=0.5,
                                      consecutive_branch_penalty=0.05)
    assert branch_settings(cfg, sample, validate=True) is None
    assert branch_settings(cfg, SamplingParams(n=16, seed=0, do_sample=False), validate=False) is None


@pytest.mark.parametrize(("override", "message"), [
    (f"{ROLLOUT}.initial_rollouts=5", r"initial_rollouts=5 must be an integer from 1 to rollout.n=4"),
    (f"{ROLLOUT}.initial_rollouts=0", r"initial_rollouts=0"),
    (f"{ROLLOUT}.beam_size=0", r"beam_size=0 must be an integer of at least 1"),
    (f"{ROLLOUT}.branch_probability=1.5", r"branch_probability=1.5 is not a probability"),
    (f"{ROLLOUT}.entropy_window=0", r"entropy_window=0"),
    (f"{ROLLOUT}.consecutive_branch_penalty=-1", r"consecutive_branch_penalty=-1"),
    (f"{ROLLOUT}.multi_turn.format=json", r"unknown actor_rollout_ref.rollout.multi_turn.format 'json'"),
    (f"{ROLLOUT}.multi_turn.tool_response_truncate_side=top", r"tool_response_truncate_side 'top'"),
    (f"{ROLLOUT}.multi_turn.max_tool_response_length=0", r"max_tool_response_length=0"),
    (f"{ROLLOUT}.tools.call_limit=-1", r"call_limit=-1"),
])
def test_a_bad_agentic_value_names_its_key(override, message):
    cfg = load_config("ppo_trainer", [*REQUIRED, f"{ROLLOUT}.n=4", *ECHO, override])
    with pytest.raises(ArcherError, match=message):
        check_config(cfg)


def test_call_limit_zero_with_tools_is_refused_naming_the_key():
    """With no call allowed, every response that calls a tool ends at that call and the tool never runs."""
    cfg = load_config("ppo_trainer", [*REQUIRED, *ECHO, f"{ROLLOUT}.tools.call_limit=0"])
    with pytest.raises(ArcherError) as err:
        check_config(cfg)
    assert err.value.problem == (f"{ROLLOUT}.tools.call_limit=0 with tools configured (python): every response "
                                 "that calls a tool would end at its first call, and no tool would ever run")
    assert f"set {ROLLOUT}.tools.call_limit" in err.value.fix
    check_config(load_config("ppo_trainer", [*REQUIRED, f"{ROLLOUT}.tools.call_limit=0"]))  # no tools: moot
    check_config(load_config("ppo_trainer", [*REQUIRED, *ECHO, f"{ROLLOUT}.tools.call_limit=1"]))


@pytest.mark.parametrize("override", [f"{ROLLOUT}.beam_size=2", f"{ROLLOUT}.initial_rollouts=2",
                                      f"{ROLLOUT}.enable_dynamic_rollouts=true"])
def test_branching_without_a_tool_is_refused(override):
    cfg = load_config("ppo_trainer", [*REQUIRED, f"{ROLLOUT}.n=4", override])
    with pytest.raises(ArcherError, match="no tool is configured") as err:
        check_config(cfg)
    assert "tools.tool_instances" in err.value.fix
    check_config(load_config("ppo_trainer", [*REQUIRED, f"{ROLLOUT}.n=4", override, *ECHO]))


# -- the rollout worker ---------------------------------------------------------------------------------------------
def test_the_rollout_worker_lays_out_tool_output_as_attended_context():
    tok = tokenizer()

    def script(state, session):
        return Turn("<python>print(1)</python>") if state.turns == 0 else Turn(" done", eos=True)

    cfg = rollout_cfg(*ECHO, f"{ROLLOUT}.n=2", "data.max_response_length=64")
    worker = RolloutWorker(ScriptedEngine(script, tok), cfg, device=torch.device("cpu"), tokenizer=tok)
    ids = [tok.encode("q one"), tok.encode("q")]
    width = max(map(len, ids))
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
    prompts = Batch({"input_ids": torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in ids]),
                     "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)}, {"uid": ["a", "b"]})
    batch = worker.generate_sequences(prompts, sampling_params(cfg, validate=False, seed=0))
    call, answer, done = (tok.encode("<python>print(1)</python>"), tok.encode(" <result>\n") + tok.encode("7")
                          + tok.encode("\n</result>"), tok.encode(" done") + [tok.eos_token_id])
    learned = [1] * len(call) + [0] * len(answer) + [1] * len(done)
    assert batch["uid"].tolist() == ["a", "a", "b", "b"]
    assert batch["responses"].tolist() == [call + answer + done] * 4
    assert batch["response_mask"].tolist() == [learned] * 4
    assert batch["tool_mask"].tolist() == [[1 - m for m in learned]] * 4
    assert response_attention(batch).tolist() == [[1] * len(learned)] * 4
    assert batch["attention_mask"][:, :width].tolist() == mask[[0, 0, 1, 1]].tolist()
    assert torch.equal(batch["position_ids"], (batch["attention_mask"].cumsum(1) - 1).clamp(min=0))
    assert batch["num_tool_calls"].tolist() == [1] * 4 and batch["num_turns"].tolist() == [2] * 4
    assert batch["branch_parent"].tolist() == [-1] * 4 and batch["finish_reason"].tolist() == ["eos"] * 4
    assert batch.info[ROLLOUT_STATS].metrics()["tools/python/calls"] == 4.0


def test_a_worker_with_tools_needs_the_tokenizer():
    with pytest.raises(ValueError, match="tokenizer"):
        RolloutWorker(ScriptedEngine(lambda s, _: Turn("x")), rollout_cfg(*ECHO), device=torch.device("cpu"))


def test_the_rollout_worker_gives_each_prompt_its_rows_tools():
    tok = tokenizer()

    def script(state, session):
        return Turn("<python>print(1)</python>") if state.turns == 0 else Turn(" done", eos=True)

    cfg = rollout_cfg(*ECHO, "data.max_response_length=256")
    worker = RolloutWorker(ScriptedEngine(script, tok), cfg, device=torch.device("cpu"), tokenizer=tok)
    ids = tok.encode("q")
    prompts = Batch({"input_ids": torch.tensor([ids, ids]), "attention_mask": torch.ones(2, len(ids), dtype=torch.long),
                     "position_ids": torch.arange(len(ids)).repeat(2, 1)}, {"tools": [None, []]})
    batch = worker.generate_sequences(prompts, sampling_params(cfg, validate=False, seed=0))
    texts = [tok.decode(r[:int(m.sum())], skip_special_tokens=True)
             for r, m in zip(batch["responses"], response_attention(batch), strict=True)]
    assert "<result>\n7\n</result>" in texts[0]
    assert "Error: the tool 'python' is not available for this question (its tools: none)." in texts[1]
    assert batch.info[ROLLOUT_STATS].metrics()["tools/disallowed_calls"] == 1.0


def test_rows_may_name_only_configured_tools():
    check_row_tools([["python"], None, []], rollout_cfg(*ECHO), "train.jsonl")
    check_row_tools([["search"]], rollout_cfg(), "train.jsonl")  # no tools configured: nothing runs
    with pytest.raises(ArcherError, match=r"train.jsonl: rows name tool\(s\) \['bing', 'search'\] in their tools, "
                                          r"which actor_rollout_ref.rollout.tools.tool_instances does not configure "
                                          r"\(its tools: \['python'\]\)"):
        check_row_tools([["python", "search"], ["bing"]], rollout_cfg(*ECHO), "train.jsonl")


def test_tool_call_tags_come_from_the_config_as_the_built_format_has_them(tiny_model_dir):
    """The trainer reads the call tags from the config (no worker attribute): the same tags the rollout's own
    call format has, for ARPO's tags (a param's trigger tag, a class default) and hermes."""
    from archer.models.loading import load_tokenizer
    from archer.rollout.agentic_config import build_agentic_rollout, tool_call_tags

    assert tool_call_tags(rollout_cfg()) == ()
    arpo = rollout_cfg(*ECHO, f"+{ROLLOUT}.tools.tool_instances.calc.class_path=agentic_support.Echo",
                       f"+{ROLLOUT}.tools.tool_instances.calc.params.trigger_tag=calc")
    tok = load_tokenizer(tiny_model_dir)
    for cfg, want in ((arpo, (("<python>", "</python>"), ("<calc>", "</calc>"))),
                      (rollout_cfg(*ECHO, f"{ROLLOUT}.multi_turn.format=hermes"), (("<tool_call>", "</tool_call>"),))):
        assert tool_call_tags(cfg) == want
        built = build_agentic_rollout(ScriptedEngine([]), tok, cfg,
                                      chat_template=None if tok.chat_template else "{{ messages }}")
        assert built.format.call_tags == want
