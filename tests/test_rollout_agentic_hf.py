"""The agentic loop end to end on the HF engine with a micro model that calls tools (tests/tool_model_support.py),
the real Python sandbox and the search tool on ARPO's cache file: the actor worker's batch (masks, tool flags,
per-row counts), log-probs equal to the training forward over the whole sequence, validation through the same
loop, a policy update that tool text does not reach, and `archer train` on ARPO's train_10k.parquet."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tool_model_support import (
    PYTHON_ANSWER,
    SEARCH_ANSWER,
    SEARCH_CACHE,
    TRAIN_FILE,
    arpo_rows,
    tool_model,
)

from archer.batch import Batch, response_attention
from archer.config.loader import load_config
from archer.data.loader import collate_prompts
from archer.models.loading import load_tokenizer
from archer.workers.actor import ActorWorker
from archer.workers.results import ROLLOUT_STATS

CPU = torch.device("cpu")
ROLLOUT = "actor_rollout_ref.rollout"
TOOLS = [f"+{ROLLOUT}.tools.tool_instances.python.class_path=python",
         f"+{ROLLOUT}.tools.tool_instances.search.class_path=search",
         f"+{ROLLOUT}.tools.tool_instances.search.params.cache_file={SEARCH_CACHE}"]
pytestmark = pytest.mark.skipif(not TRAIN_FILE.is_file(), reason="ARPO's data is not in ../shared/data/arpo")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tool_model(tmp_path_factory.mktemp("tool_model"))


def make_actor(model_dir: Path, *overrides: str) -> ActorWorker:
    cfg = load_config("ppo_trainer", [f"actor_rollout_ref.model.path={model_dir}", "data.train_files=x",
                                      "data.max_response_length=96", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                                      "actor_rollout_ref.actor.optim.lr=0", *TOOLS, *overrides])
    return ActorWorker(cfg.actor_rollout_ref, device=CPU, total_steps=2, tokenizer=load_tokenizer(model_dir))


def arpo_prompts(model_dir: Path, count: int = 2) -> Batch:
    tokenizer = load_tokenizer(model_dir)
    items = []
    for i, row in enumerate(arpo_rows(count)):
        text = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        items.append({"prompt_ids": tokenizer(text)["input_ids"], "data_source": row["data_source"],
                      "ability": row["ability"], "ground_truth": row["reward_model"]["ground_truth"], "uid": f"u{i}"})
    return collate_prompts(items, tokenizer.pad_token_id)


def tool_text(batch: Batch, row: int, tokenizer) -> list[str]:
    """The runs of tool tokens of a row, decoded."""
    mask = batch["tool_mask"][row].tolist() + [0]
    ids = batch["responses"][row].tolist()
    runs, start = [], None
    for i, flag in enumerate(mask):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append(tokenizer.decode(ids[start:i]))
            start = None
    return runs


@pytest.mark.parametrize("engine", ["hf", "fast"])  # on a GPU, auto runs the loop on the fast engine's sessions
def test_training_rollout_with_real_tools_lays_out_tool_output_as_context(model_dir, engine):
    actor = make_actor(model_dir, f"{ROLLOUT}.name={engine}", f"{ROLLOUT}.n=4", f"{ROLLOUT}.initial_rollouts=2",
                       f"{ROLLOUT}.beam_size=2", f"{ROLLOUT}.branch_probability=1.0", f"{ROLLOUT}.entropy_weight=0.0")
    tokenizer = load_tokenizer(model_dir)
    prompts = arpo_prompts(model_dir)
    prompts.info.update(validate=False, seed=3)
    batch = actor.generate_sequences(prompts)
    assert len(batch) == 8 and batch["uid"].tolist() == ["u0"] * 4 + ["u1"] * 4
    learned, tool = batch["response_mask"], batch["tool_mask"]
    present = response_attention(batch)
    assert torch.equal(present, learned + tool) and int((learned * tool).sum()) == 0
    assert torch.equal(batch["input_ids"], torch.cat([batch["prompts"], batch["responses"]], dim=1))
    answers = [t for r in range(8) for t in tool_text(batch, r, tokenizer)]
    assert f" <result>\n{SEARCH_ANSWER}\n</result>" in answers  # the cache answered the memorised search
    assert f" <result>\n{PYTHON_ANSWER}\n</result>" in answers  # the sandbox ran the memorised code
    assert all(a.startswith(" <result>\n") and a.endswith("\n</result>") for a in answers)
    for r in range(8):
        length = int(present[r].sum())
        assert length <= 96 and learned[r, length - 1] == 1  # never ends on tool output
        assert batch["num_tool_calls"][r] == len(tool_text(batch, r, tokenizer))  # every counted call answered
    parents, positions = batch["branch_parent"].tolist(), batch["branch_position"].tolist()
    assert parents[0:2] == [-1, -1] and parents[4:6] == [-1, -1]  # 2 global samples, then branches or refills
    for r, (parent, position) in enumerate(zip(parents, positions)):
        assert (parent >= 0) == (position >= 0)
        if parent >= 0:  # the branch shares its parent's tokens up to the tool answer it branched after
            p = r // 4 * 4 + parent
            assert torch.equal(batch["responses"][r, :position], batch["responses"][p, :position])
            assert tool[r, position - 1] == 1 and learned[r, position] == 1
    stats = batch.info[ROLLOUT_STATS]
    assert sum(p >= 0 for p in parents) == len(stats.branch_entropies)
    metrics = stats.metrics()
    assert metrics["tools/search/calls"] >= 1 and metrics["tools/python/calls"] >= 1
    assert metrics["rollout/initial_rollouts"] == 2.0
    # the engine's log-probs and entropies are those of the training forward over prompt, model and tool tokens
    scored = actor.compute_log_prob(batch)
    valid = learned.bool()
    torch.testing.assert_close(batch["rollout_log_probs"][valid], scored["old_log_probs"][valid], atol=2e-4, rtol=0)
    torch.testing.assert_close(batch["rollout_entropies"][valid], scored["entropies"][valid], atol=2e-4, rtol=0)
    assert torch.all(batch["rollout_log_probs"][~valid] == 0)


def test_the_fast_engines_running_batch_gives_the_hf_engines_responses_and_prefills_once(model_dir):
    """The same loop on both engines: the fast engine's continuous sessions (trajectories resumed as their tools
    answer, refills and branches started speculatively) give the responses of the hf engine's rounds (both
    sample with the same per-row noise); and each prompt and each tool answer is prefilled once: fresh samples
    share the prompt's pages, branches their branch point's."""
    actors = {engine: make_actor(model_dir, f"{ROLLOUT}.name={engine}", f"{ROLLOUT}.n=4",
                                 f"{ROLLOUT}.initial_rollouts=1", f"{ROLLOUT}.beam_size=2",
                                 f"{ROLLOUT}.branch_probability=0.5", f"{ROLLOUT}.entropy_weight=0.0")
              for engine in ("fast", "hf")}
    prompts = arpo_prompts(model_dir)
    prompts.info.update(validate=False, seed=4)
    scheduler = actors["fast"].rollout.engine.scheduler
    prefilled = scheduler.counters.prefilled
    fast, hf = (actors[engine].generate_sequences(prompts) for engine in ("fast", "hf"))
    for key in ("responses", "response_mask", "tool_mask"):
        assert torch.equal(fast[key], hf[key]), key
    for key in ("branch_parent", "branch_position", "num_tool_calls", "finish_reason"):
        assert fast[key].tolist() == hf[key].tolist(), key
    torch.testing.assert_close(fast["rollout_log_probs"], hf["rollout_log_probs"], atol=2e-4, rtol=0)
    parents, positions = fast["branch_parent"].tolist(), fast["branch_position"].tolist()
    assert sum(p >= 0 for p in parents) >= 1 and sum(p < 0 for p in parents) > len(prompts)  # branches, refills
    own_tool_tokens = sum(int(fast["tool_mask"][r, max(position, 0):].sum()) for r, position in enumerate(positions))
    prompt_tokens = sum(int(m.sum()) - 1 for m in prompts["attention_mask"])
    assert scheduler.counters.prefilled - prefilled == prompt_tokens + own_tool_tokens
    assert not actors["fast"].rollout.engine.live and not scheduler.busy  # every sequence released, none decodes
    metrics = fast.info[ROLLOUT_STATS].metrics()
    assert 1 <= metrics["rollout/decode_batch_mean"] <= 8 and 0 < metrics["rollout/decode_occupancy"] <= 1


def test_validation_runs_the_same_loop_without_branches(model_dir):
    actor = make_actor(model_dir, f"{ROLLOUT}.n=4", f"{ROLLOUT}.initial_rollouts=1", f"{ROLLOUT}.beam_size=4",
                       f"{ROLLOUT}.branch_probability=1.0", f"{ROLLOUT}.val_kwargs.n=2")
    prompts = arpo_prompts(model_dir, count=1)
    prompts.info.update(validate=True, seed=0)
    batch = actor.generate_sequences(prompts)
    assert len(batch) == 2 and batch["branch_parent"].tolist() == [-1, -1]  # val_kwargs.n, independent samples
    assert batch["num_tool_calls"].tolist()[0] >= 1 and batch["tool_mask"].sum() > 0
    assert torch.equal(batch["responses"][0], batch["responses"][1])  # greedy (val_kwargs), twice the same


def test_the_policy_update_never_reads_tool_tokens(model_dir):
    """Gradients reach the model's tokens only: changing the advantages and old log-probs on tool tokens leaves
    the loss and the update exactly as they were."""
    actor = make_actor(model_dir, f"{ROLLOUT}.n=2")
    prompts = arpo_prompts(model_dir)
    prompts.info.update(validate=False, seed=1)
    batch = actor.generate_sequences(prompts)
    tool = batch["tool_mask"].bool()
    assert tool.any()
    batch = batch.union(actor.compute_log_prob(batch))
    advantages = torch.tensor([1.0, -1.0, 0.5, 2.0])[:, None] * batch["response_mask"]

    def loss(garbage: float) -> dict[str, float]:
        b = batch.select(list(batch.tensors) + list(batch.rows))
        b["advantages"] = torch.where(tool, garbage, advantages)
        b["old_log_probs"] = torch.where(tool, -garbage, batch["old_log_probs"])
        return actor.update_actor(b).metrics

    clean, dirty = loss(0.0), loss(1e3)
    assert clean["actor/pg_loss"] == pytest.approx(dirty["actor/pg_loss"], abs=1e-6)
    assert clean["actor/grad_norm"] == pytest.approx(dirty["actor/grad_norm"], rel=1e-5)
    # ratio 1 on every learned token: token-mean of -A over the learned tokens
    learned = batch["response_mask"].float()
    assert clean["actor/pg_loss"] == pytest.approx(float(-(advantages * learned).sum() / learned.sum()), abs=1e-5)


def test_archer_train_runs_two_steps_on_arpos_data_with_both_tools(model_dir, tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "archer.cli", "train", f"actor_rollout_ref.model.path={model_dir}",
         f"data.train_files={TRAIN_FILE}", "algorithm=arpo", "data.train_batch_size=1", f"{ROLLOUT}.n=4",
         f"{ROLLOUT}.initial_rollouts=2", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
         "data.max_prompt_length=768", "data.filter_overlong_prompts=true", "data.max_response_length=96",
         "trainer.total_training_steps=2", "trainer.device=cpu", "trainer.logger=[jsonl]", "trainer.plots=false",
         f"trainer.default_local_dir={run}", f"trainer.rollout_data_dir={run / 'rollouts'}",
         f"{ROLLOUT}.multi_turn.max_tool_response_length=200", "+trainer.entropy_trace.enable=true", *TOOLS],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        for key in ("rollout/branches", "rollout/initial_rollouts", "rollout/refills", "tools/search/calls",
                    "tools/python/calls", "tools/calls_per_response", "tools/call_limit_reached", "actor/pg_loss"):
            assert key in line, key
        assert line["rollout/initial_rollouts"] == 2.0
        assert line["rollout/branches"] + line["rollout/refills"] == 2.0  # 1 prompt x (4 - 2)
    dump = [json.loads(x) for x in (run / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert len(dump) == 4
    assert {r["data_source"] for r in dump} == {"DR_grpo_mix"}
    assert any("<result>" in r["output"] for r in dump)  # the reward read the tool output
    check_tool_trace(run / "entropy_trace")


def check_tool_trace(trace: Path) -> None:
    """The entropy trace of the tool run: its tool fields, and each branch is its parent's tokens up to the tool
    answer it branched after, with the same entropy there (the same context); the explorer's tree agrees."""
    from archer.trace.format import TraceReader
    from archer.viz.explorer import Explorer

    reader = TraceReader(trace)
    assert reader.summary["call_tags"] == [["<python>", "</python>"], ["<search>", "</search>"]]  # the run's tools
    branches = 0
    for step in reader.steps():
        arrays = reader.load_step(step)
        tool, mask = arrays["tool_mask"], arrays["response_mask"]
        assert tool.any() and not (tool & mask).any() and arrays["num_tool_calls"].max() >= 1
        assert set(arrays["finish_reason"].tolist()) <= {"eos", "stop", "length", "call_limit"}
        tree = Explorer(trace).branch_tree(step, 0)[1]
        assert sorted(tree["row"].tolist()) == [0, 1, 2, 3]
        for r, p, position, entropy in zip(tree["row"], tree["parent_row"], tree["branch_position"],
                                           tree["branch_token_entropy"]):
            assert arrays["branch_parent"][r] == (arrays["sample_index"][p] if p >= 0 else -1)
            if p < 0:
                continue
            branches += 1
            assert (arrays["responses"][r, :position] == arrays["responses"][p, :position]).all()
            assert tool[r, position - 1] and mask[r, position]
            assert entropy == pytest.approx(float(arrays["entropies"][p, position]), abs=2e-2)
    assert branches >= 1
