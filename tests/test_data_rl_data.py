"""archer.data.rl_data: the RL trainer's tokenizer, datasets and loader built from the ``data`` config, every
data.* key read there (a non-default prompt_key and reward_fn_key included); rows without a ground truth and
files without rows refused at load time."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from archer.config.loader import load_config
from archer.data.loader import collate_prompts
from archer.data.rl_data import build_rl_data
from archer.errors import ArcherError
from archer.models.loading import load_tokenizer


def write_rows(path: Path, questions: list[str], truths: list[str | None], *, prompt_key: str = "prompt",
               task: str | None = None) -> Path:
    columns: dict[str, list] = {
        "data_source": ["archer/arithmetic"] * len(questions),
        prompt_key: [[{"role": "user", "content": q}] for q in questions],
        "reward_model": [{"ground_truth": t, "style": "rule"} for t in truths],
    }
    if task is not None:
        columns["task"] = [task] * len(questions)
    pq.write_table(pa.table(columns), path)
    return path


def data_config(model: Path, *overrides: str):
    return load_config("ppo_trainer", [f"actor_rollout_ref.model.path={model}", *overrides]).data


def test_every_data_key_is_read_from_the_config(tiny_model_dir: Path, tmp_path: Path) -> None:
    train = write_rows(tmp_path / "train.parquet", [f"what is {a} + {a}?" for a in range(6)], [str(2 * a) for a in range(6)],
                       prompt_key="question", task="sums")
    val = write_rows(tmp_path / "val.parquet", ["what is 9 + 9?"], ["18"], prompt_key="question", task="sums")
    cfg = data_config(tiny_model_dir, f"data.train_files={train}", f"data.val_files=[{val}]", "data.prompt_key=question",
                      "data.reward_fn_key=task", "data.train_batch_size=2", "data.gen_batch_size=3",
                      "data.shuffle=false", "data.max_prompt_length=64")
    data = build_rl_data(cfg, model_path=tiny_model_dir, chat_template=None)
    assert data.tokenizer.name_or_path == load_tokenizer(tiny_model_dir).name_or_path
    assert (len(data.train), len(data.val)) == (6, 1)
    assert data.loader.batch_size == 3  # gen_batch_size, the prompts of one generation batch
    first = data.loader.next_batch()
    assert [item["index"] for item in first] == [0, 1, 2]  # shuffle=false
    assert first[1]["raw_prompt"] == [{"role": "user", "content": "what is 1 + 1?"}]
    assert first[1]["ground_truth"] == "2" and first[1]["data_source"] == "archer/arithmetic"
    batch = collate_prompts(first, data.tokenizer.pad_token_id)
    assert list(batch["task"]) == ["sums"] * 3  # the reward_fn_key column travels with the prompts
    template = data.tokenizer.apply_chat_template(first[1]["raw_prompt"], add_generation_prompt=True, tokenize=False)
    assert first[1]["prompt_ids"] == data.tokenizer(template, add_special_tokens=False)["input_ids"]


def test_overlong_prompts_and_custom_chat_template_follow_the_config(tiny_model_dir: Path, tmp_path: Path) -> None:
    train = write_rows(tmp_path / "train.parquet", ["what is 1 + 2?", "what is 1 + 2 + 3 + 4 + 5 + 6 + 7 + 8?"],
                       ["3", "36"])
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    cfg = data_config(tiny_model_dir, f"data.train_files={train}", "data.train_batch_size=1",
                      "data.max_prompt_length=12", "data.filter_overlong_prompts=true")
    data = build_rl_data(cfg, model_path=tiny_model_dir, chat_template=template)
    ids = data.tokenizer("what is 1 + 2?", add_special_tokens=False)["input_ids"]
    assert len(ids) <= 12
    assert len(data.train) == 1 and data.train[0]["prompt_ids"] == ids
    assert data.val is None
    cut = data_config(tiny_model_dir, f"data.train_files={train}", "data.train_batch_size=1",
                      "data.max_prompt_length=12", "data.truncation=left")
    truncated = build_rl_data(cut, model_path=tiny_model_dir, chat_template=template)
    long_ids = data.tokenizer("what is 1 + 2 + 3 + 4 + 5 + 6 + 7 + 8?", add_special_tokens=False)["input_ids"]
    assert [item["prompt_ids"] for item in (truncated.train[0], truncated.train[1])] == [ids, long_ids[-12:]]


def test_rows_without_ground_truth_are_an_error_naming_file_count_and_first_row(tiny_model_dir: Path,
                                                                                 tmp_path: Path) -> None:
    train = write_rows(tmp_path / "train.parquet", ["what is 1 + 1?", "what is 2 + 2?", "what is 3 + 3?"],
                       ["2", None, None])
    cfg = data_config(tiny_model_dir, f"data.train_files={train}", "data.train_batch_size=1")
    with pytest.raises(ArcherError) as err:
        build_rl_data(cfg, model_path=tiny_model_dir, chat_template=None)
    assert err.value.problem == (f"{train}: 2 of 3 rows have no reward_model.ground_truth; the first is row 1 "
                                 "('what is 2 + 2?')")
    assert "data.require_ground_truth=false" in err.value.fix and "ground_truth=None" in err.value.fix


def test_a_reward_model_column_missing_altogether_counts_every_row(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "no_reward_model.parquet"
    pq.write_table(pa.table({"data_source": ["a", "a"], "prompt": ["hi", "ho"]}), path)
    cfg = data_config(tiny_model_dir, f"data.train_files={path}", "data.train_batch_size=1")
    with pytest.raises(ArcherError, match=r"2 of 2 rows have no reward_model.ground_truth; the first is row 0 \('hi'\)"):
        build_rl_data(cfg, model_path=tiny_model_dir, chat_template=None)


def test_the_opt_out_hands_none_not_the_text_none(tiny_model_dir: Path, tmp_path: Path) -> None:
    train = write_rows(tmp_path / "train.parquet", ["what is 1 + 1?", "what is 2 + 2?"], ["2", None])
    cfg = data_config(tiny_model_dir, f"data.train_files={train}", "data.train_batch_size=2",
                      "data.require_ground_truth=false", "data.shuffle=false")
    data = build_rl_data(cfg, model_path=tiny_model_dir, chat_template=None)
    batch = collate_prompts(data.loader.next_batch(), data.tokenizer.pad_token_id)
    assert list(batch["ground_truth"]) == ["2", None]


def test_a_file_without_rows_says_so(tiny_model_dir: Path, tmp_path: Path) -> None:
    good = write_rows(tmp_path / "good.parquet", ["what is 1 + 1?"], ["2"])
    empty = tmp_path / "empty.parquet"
    pq.write_table(pq.read_table(good).slice(0, 0), empty)
    for files in (f"data.train_files={empty}", f"data.train_files={good} data.val_files={empty}"):
        cfg = data_config(tiny_model_dir, *files.split(), "data.train_batch_size=1")
        with pytest.raises(ArcherError) as err:
            build_rl_data(cfg, model_path=tiny_model_dir, chat_template=None)
        assert err.value.problem == f"{empty} has no rows"
        assert "data.train_files / data.val_files" in err.value.fix


def test_a_missing_reward_fn_key_column_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    train = write_rows(tmp_path / "train.parquet", ["what is 1 + 1?"], ["2"])
    cfg = data_config(tiny_model_dir, f"data.train_files={train}", "data.train_batch_size=1", "data.reward_fn_key=task")
    with pytest.raises(ArcherError) as err:
        build_rl_data(cfg, model_path=tiny_model_dir, chat_template=None)
    assert err.value.problem.startswith(f"{train} has no column(s) ['task']; its columns are ")
    assert "data.reward_fn_key" in err.value.fix
