"""Tests of archer.data.tasks: generated problems, their rewards, and the parquet files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from archer.data.sft_dataset import SFTDataset
from archer.data.tasks import TASKS, generate_rows, write_task_files
from archer.data.tasks.arithmetic import work_out
from archer.data.tasks.tool_arithmetic import RESULT_FRAME, estimate
from archer.errors import ArcherError
from archer.models.tiny import train_tokenizer
from archer.rewards.routing import default_compute_score
from archer.tools.python_tool import PythonTool

ARITHMETIC = re.compile(r"Compute (\d+(?:[-+*]\d+)+)\.")
COUNTDOWN = re.compile(r"Use (\d+(?:, \d+)*) to make (\d+)\.")


def score(row: dict, response: str) -> float | dict:
    return default_compute_score(
        row["data_source"], response, row["reward_model"]["ground_truth"], row["extra_info"], row["ability"]
    )


def test_work_out_by_hand() -> None:
    assert work_out([3, 4, 5, 2], ["+", "*", "-"]) == (["4*5=20.", "3+20=23.", "23-2=21."], 21)
    assert work_out([10, 30, 7], ["-", "+"]) == (["10-30=-20.", "-20+7=-13."], -13)
    assert work_out([2, 3, 4], ["*", "*"]) == (["2*3=6.", "6*4=24."], 24)


@pytest.mark.parametrize("knobs", [{}, {"num_operands": 4, "max_operand": 20, "ops": "+-*"}, {"ops": ["+"]}])
def test_arithmetic_rows(knobs: dict) -> None:
    rows = generate_rows("arithmetic", 30, seed=3, split="val", **knobs)
    for i, row in enumerate(rows):
        question = row["prompt"][0]["content"]
        expression = ARITHMETIC.fullmatch(question).group(1)
        operands = [int(x) for x in re.findall(r"\d+", expression)]
        assert len(operands) == knobs.get("num_operands", 3)
        assert all(1 <= x <= knobs.get("max_operand", 99) for x in operands)
        answer = eval(expression)  # the test's own check of a digits-and-operators string
        assert row["data_source"] == "archer/arithmetic" and row["ability"] == "math"
        assert row["prompt"] == [{"role": "user", "content": question}]
        assert row["reward_model"] == {"style": "rule", "ground_truth": str(answer)}
        solution = row["extra_info"]["solution"]
        assert row["extra_info"] == {"split": "val", "index": i, "question": question, "solution": solution}
        assert solution.endswith(f"\\boxed{{{answer}}}")
        assert score(row, solution) == 1.0
        assert score(row, f"\\boxed{{{answer + 1}}}") == 0.0
        assert len(question) < 40
    assert len({r["prompt"][0]["content"] for r in rows}) == 30


@pytest.mark.parametrize("knobs", [{}, {"num_numbers": 4, "max_number": 9}, {"ops": "-/", "max_number": 30}])
def test_countdown_rows_are_solvable(knobs: dict) -> None:
    rows = generate_rows("countdown", 30, seed=5, **knobs)
    for row in rows:
        question = row["prompt"][0]["content"]
        match = COUNTDOWN.fullmatch(question)
        numbers, target = [int(x) for x in match.group(1).split(", ")], int(match.group(2))
        assert len(numbers) == knobs.get("num_numbers", 3)
        assert all(1 <= x <= knobs.get("max_number", 20) for x in numbers)
        assert json.loads(row["reward_model"]["ground_truth"]) == {"target": target, "numbers": numbers}
        assert row["data_source"] == "archer/countdown"
        equation = re.fullmatch(r".* <answer>(.+)</answer>", row["extra_info"]["solution"]).group(1)
        assert set(equation) <= set("0123456789()" + knobs.get("ops", "+-*/"))
        assert score(row, row["extra_info"]["solution"]) == {"score": 1.0, "acc": 1.0}
        assert score(row, f"<answer>{'+'.join(map(str, numbers))}+1</answer>") == {"score": 0.1, "acc": 0.0}
        assert score(row, "I give up") == {"score": 0.0, "acc": 0.0}


def test_countdown_first_instance_of_seed_0() -> None:
    (row,) = generate_rows("countdown", 1, seed=0)
    assert row["prompt"][0]["content"] == "Use 13, 14, 2 to make 91."
    # 14/2 = 7 and 7*13 = 91; the equation needs no parentheses
    assert row["extra_info"]["solution"] == "14/2=7. 7*13=91. <answer>14/2*13</answer>"


def test_estimate_rounds_to_two_significant_digits_half_up() -> None:
    assert [estimate(x) for x in (4821, 317, 95, 7, 4850, 995, 1049)] == [4800, 320, 95, 7, 4900, 1000, 1000]


def test_tool_arithmetic_first_instance_of_seed_0() -> None:
    (row,) = generate_rows("tool_arithmetic", 1, seed=0)
    assert row["prompt"] == [{"role": "user", "content": "Compute 964*494."}]
    assert row["data_source"] == "archer/tool_arithmetic" and row["ability"] == "math"
    assert row["reward_model"]["ground_truth"] == "476216"  # 964*494 = 476,216
    # the default solution calls the tool; the loop's " <result>\n" + what print wrote + "\n</result>" follows
    assert row["extra_info"]["solution"] == (
        "<python>print(964*494)</python> <result>\n476216\n\n</result> \\boxed{476216}")


def test_tool_solutions_hold_what_the_python_tool_answers() -> None:
    tool = PythonTool()
    for row in generate_rows("tool_arithmetic", 3, seed=1, num_operands=3, ops="+-*"):
        solution = row["extra_info"]["solution"]
        code = re.fullmatch(r"<python>(.*)</python>.*", solution, re.DOTALL).group(1)
        assert f"</python>{RESULT_FRAME[0]}{tool.execute(code).text}{RESULT_FRAME[1]} \\boxed{{" in solution


@pytest.mark.parametrize("knobs", [{"tool_fraction": 0.5}, {"num_operands": 3, "min_operand": 10, "max_operand": 99,
                                                            "ops": "+*", "tool_fraction": 0.5}])
def test_tool_arithmetic_rows_call_the_tool_or_estimate(knobs: dict) -> None:
    rows = generate_rows("tool_arithmetic", 200, seed=4, **knobs)
    calls = 0
    for row in rows:
        expression = ARITHMETIC.fullmatch(row["prompt"][0]["content"]).group(1)
        operands = [int(x) for x in re.findall(r"\d+", expression)]
        assert len(operands) == knobs.get("num_operands", 2)
        assert all(knobs.get("min_operand", 100) <= x <= knobs.get("max_operand", 999) for x in operands)
        assert set(re.findall(r"[-+*]", expression)) <= set(knobs.get("ops", "*"))
        answer = eval(expression)  # the test's own check of a digits-and-operators string
        assert row["reward_model"]["ground_truth"] == str(answer)
        solution = row["extra_info"]["solution"]
        if solution.startswith("<python>"):
            calls += 1
            assert solution == (f"<python>print({expression})</python> <result>\n{answer}\n\n</result> "
                                f"\\boxed{{{answer}}}")
            assert score(row, solution) == {"score": 1.0, "acc": 1.0, "used_tool": 1.0}
        else:
            guess = eval(re.sub(r"\d+", lambda m: str(estimate(int(m.group()))), expression))
            assert solution == f"In my head, {expression} is about {guess}. \\boxed{{{guess}}}"
            assert score(row, solution) == {"score": float(guess == answer), "acc": float(guess == answer),
                                            "used_tool": 0.0}
    assert 80 <= calls <= 120
    # the share of tool calls changes the solutions, never the problems drawn
    for fraction in (0.0, 1.0):
        other = generate_rows("tool_arithmetic", 200, seed=4, **{**knobs, "tool_fraction": fraction})
        assert [r["prompt"] for r in other] == [r["prompt"] for r in rows]
        assert {r["extra_info"]["solution"].startswith("<python>") for r in other} == {bool(fraction)}


def test_tool_solutions_train_only_the_models_own_tokens(tmp_path: Path) -> None:
    paths = write_task_files("tool_arithmetic", tmp_path, n_train=1, n_val=1, n_sft=40, seed=0, tool_fraction=0.5)
    rows = read(paths["sft"])
    tokenizer = train_tokenizer([t for r in rows for t in (r["prompt"][0]["content"], r["response"])], 400)
    dataset = SFTDataset.from_rows(rows, tokenizer, max_length=128)
    for row, item in zip(rows, dataset, strict=True):
        ids, mask = item["input_ids"].tolist(), item["loss_mask"].tolist()
        trained = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
        response = row["response"]
        result = re.search(r" <result>\n(\d+\n)\n</result>", response)
        if result is None:  # an estimate: the whole response and the end of the turn are learned
            assert trained == response + "<|im_end|>"
            continue
        # the call and the answer are learned; the tool's result (space before it included) is context,
        # tokenised as the rollout loop appends it: the frame and the answer apart (the last untrained token is
        # the "\n" after the turn)
        assert trained == response.replace(result.group(), "") + "<|im_end|>"
        start = mask.index(1)
        untrained = [t for t, m in zip(ids[start:], mask[start:], strict=True) if not m]
        pieces = (RESULT_FRAME[0], result.group(1), RESULT_FRAME[1])
        assert untrained[:-1] == [t for piece in pieces for t in tokenizer.encode(piece, add_special_tokens=False)]
        assert tokenizer.decode(untrained[-1:]) == "\n"


def test_tool_arithmetic_knob_errors() -> None:
    with pytest.raises(ArcherError, match="max_operand=99 is below min_operand=100"):
        generate_rows("tool_arithmetic", 1, seed=0, max_operand=99)
    with pytest.raises(ArcherError, match=r"tool_fraction=1.5 must be a number in \[0, 1\]"):
        generate_rows("tool_arithmetic", 1, seed=0, tool_fraction=1.5)
    with pytest.raises(ArcherError, match="ops='/'"):
        generate_rows("tool_arithmetic", 1, seed=0, ops="/")


def read(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


@pytest.mark.parametrize("task", sorted(TASKS))
def test_write_task_files(task: str, tmp_path: Path) -> None:
    paths = write_task_files(task, tmp_path / "a", n_train=40, n_val=15, seed=11, n_sft=25)
    assert paths == {name: tmp_path / "a" / f"{name}.parquet" for name in ("train", "val", "sft")}
    train, val, sft = read(paths["train"]), read(paths["val"]), read(paths["sft"])
    assert (len(train), len(val), len(sft)) == (40, 15, 25)
    # the validation file is what generate_rows gives for the same seed, field by field
    assert val == generate_rows(task, 15, seed=11, split="val")
    assert [r["extra_info"]["split"] for r in train] == ["train"] * 40
    assert [r["extra_info"]["index"] for r in train] == list(range(40))
    for row in train:
        assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
        scored = score(row, row["extra_info"]["solution"])
        assert (scored if isinstance(scored, float) else scored["score"]) == 1.0
    for row in sft:
        assert set(row) == {"prompt", "response"}
        assert row["prompt"][0]["role"] == "user" and len(row["prompt"]) == 1
    questions = [{r["prompt"][0]["content"] for r in rows} for rows in (train, val, sft)]
    assert (
        not questions[0] & questions[1]
        and not questions[2] & questions[1]
        and not questions[0] & questions[2]
    )


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    first = write_task_files("countdown", tmp_path / "a", n_train=20, n_val=5, seed=2, num_numbers=4)
    second = write_task_files("countdown", tmp_path / "b", n_train=20, n_val=5, seed=2, num_numbers=4)
    other = write_task_files("countdown", tmp_path / "c", n_train=20, n_val=5, seed=3, num_numbers=4)
    for name in ("train", "val", "sft"):
        assert first[name].read_bytes() == second[name].read_bytes()
        assert read(first[name]) != read(other[name])


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(ArcherError, match=r"unknown task 'sudoku'.*\['arithmetic', 'countdown', 'tool_arithmetic'\]"):
        generate_rows("sudoku", 3, seed=0)
    with pytest.raises(ArcherError, match=r"no knob\(s\) \['num_numbers'\].*'num_operands': 3"):
        write_task_files("arithmetic", tmp_path, n_train=3, n_val=3, seed=0, num_numbers=4)
    with pytest.raises(ArcherError, match="num_operands=1 must be an integer >= 2"):
        generate_rows("arithmetic", 3, seed=0, num_operands=1)
    with pytest.raises(ArcherError, match="ops='\\+%'"):
        generate_rows("arithmetic", 3, seed=0, ops="+%")
    with pytest.raises(ArcherError, match="n_val=0 must be a positive integer"):
        write_task_files("arithmetic", tmp_path, n_train=3, n_val=0, seed=0)
    # 2 operands from 1..2 joined by '+': only 4 distinct problems exist
    with pytest.raises(ArcherError, match="could only generate 4 distinct problems"):
        generate_rows("arithmetic", 5, seed=0, num_operands=2, max_operand=2, ops="+")
    with pytest.raises(ArcherError, match="could not build a solvable instance"):
        generate_rows("countdown", 1, seed=0, max_number=1, ops="-")
