"""Tests for archer.trainer.sft on the tiny model: the loss mask on real templated tokens, exact response
log-probs, gradient accumulation equal to the full batch, learning-rate schedules by hand, and a full
run whose metrics, summary, config and HF model folder are checked field by field."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig, OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from archer import cli
from archer.batch import Batch
from archer.config.loader import CONFIG_DIR, load_config
from archer.data.sft_dataset import SFTDataset, collate_sft, pack_sft
from archer.errors import ArcherError
from archer.models import packed_attention as packed_attention_module
from archer.models.loading import load_causal_lm, load_tokenizer
from archer.models.optim import LRSchedule, build_scheduler
from archer.trainer import sft
from archer.trainer.sft import response_logprobs, run_sft, sft_backward

PROBLEMS = [(2, 3), (4, 1), (7, 2), (3, 3), (6, 0), (1, 8), (5, 4), (9, 0)]


def _row(a: int, b: int) -> dict:
    return {"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
            "response": f"{a} + {b} = {a + b}. The answer is {a + b}."}


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(tmp_path: Path, model_dir: Path, **overrides: object) -> DictConfig:
    tmp_path.mkdir(parents=True, exist_ok=True)
    base = OmegaConf.load(CONFIG_DIR / "sft_trainer.yaml")
    dotlist = [f"{k}={v}" for k, v in {
        "data.train_files": _write_jsonl(tmp_path / "train.jsonl", [_row(a, b) for a, b in PROBLEMS]),
        "data.max_length": 64,
        "data.train_batch_size": 4,
        "data.micro_batch_size_per_gpu": 2,
        "model.partial_pretrain": model_dir,
        "optim.lr": 1e-2,
        "optim.warmup_steps_ratio": 0.0,
        "optim.lr_scheduler": "constant",
        "trainer.default_local_dir": tmp_path / "run",
        "trainer.total_epochs": 3,
        "trainer.logger": "[jsonl]",
        "trainer.device": "cpu",
        **overrides,
    }.items()]
    return OmegaConf.merge(base, OmegaConf.from_dotlist(dotlist))


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path):
    return load_causal_lm(tiny_model_dir, device="cpu", dtype=torch.float32)


def test_loss_mask_marks_exactly_the_response_and_end_of_turn(tok) -> None:
    row = _row(2, 3)
    item = SFTDataset.from_rows([row], tok, max_length=64)[0]
    ids, mask = item["input_ids"].tolist(), item["loss_mask"].tolist()
    prompt_text = tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    prompt_ids = tok(prompt_text, add_special_tokens=False)["input_ids"]
    response_ids = tok(row["response"], add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    tail_ids = tok("\n", add_special_tokens=False)["input_ids"]  # the template's newline after <|im_end|>
    assert ids == prompt_ids + response_ids + tail_ids
    for position, (token, flag) in enumerate(zip(ids, mask, strict=True)):
        in_response = len(prompt_ids) <= position < len(prompt_ids) + len(response_ids)
        assert flag == int(in_response), (position, tok.decode([token]))
    assert tok.decode([t for t, f in zip(ids, mask, strict=True) if f]) == row["response"] + "<|im_end|>"


def test_response_logprobs_equal_full_logits_at_masked_positions(tok, model) -> None:
    ds = SFTDataset.from_rows([_row(2, 3), _row(7, 2)], tok, max_length=64)
    batch = ds.collate([ds[0], ds[1]])
    with torch.no_grad():
        got = response_logprobs(model, batch)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    expected = []
    for row in range(2):
        for t in range(1, batch["input_ids"].shape[1]):
            if batch["loss_mask"][row, t]:
                expected.append(torch.log_softmax(logits[row, t - 1], dim=-1)[batch["input_ids"][row, t]])
    assert len(got) == int(batch["loss_mask"].sum()) == len(expected)
    torch.testing.assert_close(got, torch.stack(expected), atol=1e-5, rtol=0)


def _grads(model, batch, micro: int) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss, _ = sft_backward(model, batch, micro)
    return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_accumulation_over_micro_batches_equals_the_full_batch(tok, model) -> None:
    # rows of different lengths, so per-micro-batch averaging would weigh tokens differently
    rows = [_row(2, 3), {"prompt": "Hi", "response": "ok"}, _row(9, 0),
            {"prompt": "Add 1 and 1.", "response": "1 + 1 = 2. The answer is 2. Done, 2 it is."}]
    ds = SFTDataset.from_rows(rows, tok, max_length=64)
    batch = ds.collate([ds[i] for i in range(4)])
    loss_full, grads_full = _grads(model, batch, 4)
    loss_acc, grads_acc = _grads(model, batch, 1)
    with torch.no_grad():
        assert loss_full == pytest.approx(float(-response_logprobs(model, batch).mean()), abs=1e-6)
        per_row = [response_logprobs(model, batch.index([i])) for i in range(4)]
    assert loss_acc == pytest.approx(loss_full, abs=1e-6)
    assert grads_full.keys() == grads_acc.keys() and len(grads_full) == len(list(model.parameters()))
    for name, grad in grads_full.items():
        torch.testing.assert_close(grads_acc[name], grad, atol=1e-6, rtol=0, msg=name)
    # the mean of per-row means is a different loss: the test above can tell them apart
    assert float(-torch.stack([lp.mean() for lp in per_row]).mean()) != pytest.approx(loss_full, abs=1e-3)


@pytest.mark.parametrize(("name", "ratio", "total", "expected"), [
    ("constant", 0.0, 4, [1.0, 1.0, 1.0, 1.0]),
    ("constant", 0.5, 4, [0.0, 0.5, 1.0, 1.0]),
    # warmup 2 steps, then half a cosine over the remaining 4: 1, (1+cos(pi/4))/2, 1/2, (1+cos(3pi/4))/2
    ("cosine", 1 / 3, 6, [0.0, 0.5, 1.0, (1 + math.cos(math.pi / 4)) / 2, 0.5, (1 - math.cos(math.pi / 4)) / 2]),
    # warmup 2, 18 left: int(0.9 * 18) = 16 stable, 2 of cosine decay: 1 then 1/2
    ("wsd", 0.1, 20, [0.0, 0.5] + [1.0] * 16 + [1.0, 0.5]),
])
def test_schedules_by_hand(name: str, ratio: float, total: int, expected: list[float]) -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    schedule = LRSchedule.from_sft_optim(OmegaConf.create({"lr_scheduler": name, "warmup_steps_ratio": ratio}), total)
    scheduler = build_scheduler(optimizer, schedule)
    lrs = []
    for _ in range(total):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([2.0 * f for f in expected], abs=1e-12)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_run_sft_learns_and_writes_the_run_directory(tmp_path: Path, tiny_model_dir: Path) -> None:
    val = _write_jsonl(tmp_path / "val.jsonl", [_row(2, 3), _row(4, 1)])
    cfg = _cfg(tmp_path, tiny_model_dir, **{"data.val_files": val})
    out = run_sft(cfg)
    run = tmp_path / "run"
    assert out == run / "hf_model"

    metrics = _metrics(run)
    # 8 rows / batch 4 = 2 steps an epoch, 3 epochs; validation at each epoch end
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert [m["step"] for m in metrics if "val/loss" in m] == [2, 4, 6]
    assert all(m["train/lr"] == pytest.approx(1e-2) for m in metrics)
    assert all(m["train/grad_norm"] > 0 and m["train/num_tokens"] > 0 for m in metrics)
    losses = [m["train/loss"] for m in metrics]
    assert losses[-1] < 0.8 * losses[0]
    val_losses = [m["val/loss"] for m in metrics if "val/loss" in m]
    assert val_losses[-1] < val_losses[0]
    assert all(0.0 <= m["val/token_acc"] <= 1.0 for m in metrics if "val/loss" in m)

    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6
    assert summary["final_train_loss"] == pytest.approx(losses[-1])
    assert summary["final_val_loss"] == pytest.approx(val_losses[-1])
    assert summary["final_val_token_acc"] == pytest.approx(metrics[-1]["val/token_acc"])
    assert summary["model_path"] == str(out)
    assert summary["wall_time_s"] > 0

    saved = OmegaConf.load(run / "config.yaml")
    assert saved.data.train_files == str(tmp_path / "train.jsonl")
    assert saved.trainer.default_local_dir == str(run)
    assert saved.optim.lr == pytest.approx(1e-2)
    assert {p.name for p in (run / "plots").iterdir()} == {"loss.png", "token_acc.png", "lr.png", "grad_norm.png"}

    reloaded = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template and tokenizer("1 + 1")["input_ids"] == load_tokenizer(tiny_model_dir)("1 + 1")["input_ids"]
    ds = SFTDataset.from_rows([_row(2, 3), _row(4, 1)], tokenizer, max_length=64)
    with torch.no_grad():
        val_nll = -float(response_logprobs(reloaded, ds.collate([ds[0], ds[1]])).mean())
    assert val_nll == pytest.approx(val_losses[-1], abs=1e-4)


def test_run_sft_is_seeded_and_total_training_steps_cycles_the_data(tmp_path: Path, tiny_model_dir: Path) -> None:
    settings = {"trainer.total_training_steps": 3, "model.enable_gradient_checkpointing": False}
    run_sft(_cfg(tmp_path / "a", tiny_model_dir, **settings))
    run_sft(_cfg(tmp_path / "b", tiny_model_dir, **settings))
    first, second = _metrics(tmp_path / "a" / "run"), _metrics(tmp_path / "b" / "run")
    assert [m["step"] for m in first] == [1, 2, 3]  # the third step starts a second epoch
    assert [m["train/loss"] for m in first] == [m["train/loss"] for m in second]
    assert "val/loss" not in first[-1]


@pytest.mark.parametrize(("overrides", "problem", "fix"), [
    ({"data.train_batch_size": 9}, "8 examples, fewer than one batch", "data.train_batch_size to at most 8"),
    ({"optim.lr_scheduler": "linear"}, "optim.lr_scheduler='linear'", "cosine"),
    ({"data.micro_batch_size_per_gpu": 0}, "data.micro_batch_size_per_gpu", "data.micro_batch_size_per_gpu=4"),
    ({"data.max_length": 8}, "row 0 of", "data.truncation"),
    ({"data.response_key": "answer"}, "cannot tell the format of row 0 of", "'prompt'/'answer' (data.prompt_key/"),
])
def test_bad_settings_are_errors(tmp_path: Path, tiny_model_dir: Path, overrides: dict, problem: str,
                                 fix: str) -> None:
    with pytest.raises(ArcherError) as info:
        run_sft(_cfg(tmp_path, tiny_model_dir, **overrides))
    assert problem in info.value.problem
    assert fix in info.value.fix
    assert not (tmp_path / "run" / "hf_model").exists()


def test_missing_data_file_is_an_error(tmp_path: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(ArcherError) as info:
        run_sft(_cfg(tmp_path, tiny_model_dir, **{"data.val_files": tmp_path / "nope.parquet"}))
    assert f"{tmp_path / 'nope.parquet'} does not exist" in info.value.problem


def test_config_composes_with_the_loader() -> None:
    cfg = load_config("sft_trainer", ["data.train_files=a.parquet", "model.partial_pretrain=m",
                                      "trainer.experiment_name=e1", "data.multiturn.enable=true"])
    assert cfg.trainer.default_local_dir == "runs/archer-sft/e1"
    assert cfg.data.multiturn.enable is True and cfg.data.micro_batch_size_per_gpu == 4
    assert list(cfg.optim.betas) == [0.9, 0.95] and cfg.optim.lr == 1e-5
    with pytest.raises(ArcherError, match="unknown config key .optim.learning_rate."):
        load_config("sft_trainer", ["data.train_files=a", "model.partial_pretrain=m", "optim.learning_rate=1"])
    with pytest.raises(ArcherError, match="model.partial_pretrain"):
        load_config("sft_trainer", ["data.train_files=a"])


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _run_until_interrupted_in_step(cfg, step: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run SFT with ``cfg`` and stop it (KeyboardInterrupt) as its ``step``-th optimisation step begins."""
    real_step, calls = sft.train_step, []

    def dies(*args, **kwargs):
        calls.append(1)
        if len(calls) == step:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(sft, "train_step", dies)
    with pytest.raises(KeyboardInterrupt):
        run_sft(cfg)


def test_checkpoints_every_save_freq_and_an_interrupted_run_resumes_exactly(
        tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 6 steps with a cosine schedule after warmup (so a wrong resumed lr or optimiser state would show), a
    # checkpoint every 2 steps, the newest 2 kept; the second run dies in its 4th step, after checkpoint 2
    settings = {"trainer.save_freq": 2, "trainer.max_ckpt_to_keep": 2, "optim.lr_scheduler": "cosine",
                "optim.warmup_steps_ratio": 0.2, "model.enable_gradient_checkpointing": False}
    whole = run_sft(_cfg(tmp_path / "whole", tiny_model_dir, **settings))
    cfg = _cfg(tmp_path / "cut", tiny_model_dir, **settings)
    _run_until_interrupted_in_step(cfg, 4, monkeypatch)
    checkpoints = tmp_path / "cut" / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["global_step_2", "latest"]
    assert [m["step"] for m in _metrics(tmp_path / "cut" / "run")] == [1, 2, 3]  # step 3 logged, not checkpointed
    monkeypatch.undo()

    resumed = run_sft(cfg)  # trainer.resume_mode=auto: from global_step_2, steps 3..6 again
    keys = ("step", "train/loss", "train/lr", "train/grad_norm", "train/num_tokens")
    assert [{k: m[k] for k in keys} for m in _metrics(tmp_path / "cut" / "run")] == \
        [{k: m[k] for k in keys} for m in _metrics(tmp_path / "whole" / "run")]
    expected, got = _weights(whole), _weights(resumed)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["global_step_4", "global_step_6", "latest"]
    assert (checkpoints / "latest").read_text().strip() == "global_step_6"
    last = checkpoints / "global_step_6"
    assert {"COMPLETE", "trainer_state.pt", "model"} <= {p.name for p in last.iterdir()}
    assert not (last / "model" / "lora_adapter").exists()
    assert all(torch.equal(v, _weights(last / "model")[k]) for k, v in got.items())
    state = torch.load(last / "trainer_state.pt", weights_only=True)
    assert state["global_step"] == 6 and state["loader"] == {"epoch": 3, "position": 0}

    # resume_path continues from a named checkpoint; resume_mode=disable starts over
    again = _cfg(tmp_path / "path", tiny_model_dir, **settings, **{"trainer.resume_mode": "resume_path",
                                                                    "trainer.resume_from_path": checkpoints / "global_step_4"})
    run_sft(again)
    assert [m["step"] for m in _metrics(tmp_path / "path" / "run")] == [5, 6]
    assert all(torch.equal(v, _weights(tmp_path / "path" / "run" / "hf_model")[k]) for k, v in got.items())


@pytest.mark.parametrize(("overrides", "problem"), [
    ({"trainer.resume_mode": "sometimes"}, "unknown trainer.resume_mode 'sometimes'"),
    ({"data.format": "csv"}, "data.format='csv' is not an SFT data format"),
    ({"trainer.resume_mode": "resume_path"}, "trainer.resume_mode=resume_path but trainer.resume_from_path is not set"),
    ({"trainer.resume_mode": "resume_path", "trainer.resume_from_path": "/nonexistent"}, "is not a checkpoint of this kind of run (it needs trainer_state.pt and model/)"),
])
def test_bad_resume_and_format_settings_are_errors(tmp_path: Path, tiny_model_dir: Path, overrides: dict, problem: str) -> None:
    with pytest.raises(ArcherError) as info:
        run_sft(_cfg(tmp_path, tiny_model_dir, **overrides))
    assert problem in info.value.problem


def test_a_misspelt_data_format_suggests_the_nearest(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["sft", "--cfg", "job", "model.partial_pretrain=m", "data.train_files=f.json",
                     "data.format=sharegtp"]) == 2
    err = capsys.readouterr().err
    assert "data.format='sharegtp' is not an SFT data format" in err
    assert "fix: did you mean 'sharegpt'? use one of ['auto', 'prompt_response', 'alpaca', 'sharegpt']" in err


def test_packed_rows_give_the_unpacked_loss_and_gradient(tok, model, monkeypatch) -> None:
    rows = [_row(2, 3), {"prompt": "Say hi.", "response": "hi"}, _row(17, 25), _row(4, 1),
            {"prompt": "What is 9 + 9?", "response": "18"}]
    ds = SFTDataset.from_rows(rows, tok, max_length=64)
    items = [ds[i] for i in range(len(ds))]
    packed = pack_sft(items, ds.pad_token_id, capacity=64)
    assert len(packed) < len(items)  # several examples share a row
    loss, grads = _grads(model, ds.collate(items), micro=len(items))
    examples = []  # archer's attention of packed examples (on the CPU, one SDPA call an example and layer)
    per_example = packed_attention_module._per_sequence_sdpa
    monkeypatch.setattr(packed_attention_module, "_per_sequence_sdpa",
                        lambda q, k, v, cu, scaling, window=None: examples.append(len(cu) - 1)
                        or per_example(q, k, v, cu, scaling, window))
    packed_loss, packed_grads = _grads(model, packed, micro=1)
    assert sum(examples) == len(items) * model.config.num_hidden_layers  # no [T x T] mask: each example alone
    assert packed_loss == pytest.approx(loss, rel=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-6)
    # the same rows with the attention mask on (one causal run per row, examples seeing each other) differ
    with torch.no_grad():
        leaky = response_logprobs(model, Batch(dict(packed.tensors)))
        kept_apart = response_logprobs(model, packed)
    assert (leaky - kept_apart).abs().max() > 1e-3


@pytest.mark.parametrize("attention", ["archer", "sdpa"])
def test_packed_examples_that_start_with_a_learned_token_give_the_unpacked_loss(model, attention) -> None:
    # left truncation can cut an example so that it starts inside a response: its first token has loss_mask 1 but
    # nothing before it in the example to be predicted from (unpacked, it is column 0 of its row)
    gen = torch.Generator().manual_seed(4)
    items = [{"input_ids": torch.randint(3, 300, (n,), generator=gen), "loss_mask": torch.tensor(mask)}
             for n, mask in ((7, [0, 0, 0, 1, 1, 1, 1]), (5, [1, 1, 1, 1, 1]), (4, [1, 1, 0, 1]))]
    packed = pack_sft(items, 0, capacity=16)
    assert len(packed) == 1
    if attention == "sdpa":  # a model that does not run archer's attention: transformers' mask from the restarts
        model = copy.deepcopy(model)
        model.set_attn_implementation("sdpa")
    loss, grads = _grads(model, collate_sft(items, 0), micro=3)
    packed_loss, packed_grads = _grads(model, packed, micro=1)
    assert sft_backward(model, packed, 1)[1] == sft_backward(model, collate_sft(items, 0), 3)[1] == 4 + 4 + 2
    assert packed_loss == pytest.approx(loss, rel=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-6)


def test_run_sft_with_packing_matches_the_unpacked_run_and_reports_the_tokens_saved(tmp_path: Path,
                                                                                   tiny_model_dir: Path) -> None:
    # short and long examples mixed, so that unpacked micro-batches pad the short ones
    rows = [_row(a, b) if i % 2 else {"prompt": "Hi", "response": str(a)} for i, (a, b) in enumerate(PROBLEMS)]
    settings = {"trainer.total_training_steps": 3, "model.enable_gradient_checkpointing": False,
                "data.train_files": _write_jsonl(tmp_path / "mixed.jsonl", rows)}
    run_sft(_cfg(tmp_path / "plain", tiny_model_dir, **settings))
    run_sft(_cfg(tmp_path / "packed", tiny_model_dir, **settings, **{"data.packing": True}))
    plain, packed = _metrics(tmp_path / "plain" / "run"), _metrics(tmp_path / "packed" / "run")
    assert [m["train/loss"] for m in packed] == pytest.approx([m["train/loss"] for m in plain], rel=1e-4)
    assert [m["train/num_tokens"] for m in packed] == [m["train/num_tokens"] for m in plain]
    assert [m["train/token_slots_unpacked"] for m in packed] == [m["train/token_slots"] for m in plain]
    # packed rows hold only real tokens; unpacked micro-batches pad unless their rows happen to be equally long
    assert all(m["train/token_slots"] <= m["train/token_slots_unpacked"] for m in packed)
    summary = json.loads((tmp_path / "packed" / "run" / "summary.json").read_text())
    slots, unpacked = sum(m["train/token_slots"] for m in packed), sum(m["train/token_slots"] for m in plain)
    assert (summary["token_slots"], summary["token_slots_unpacked"]) == (slots, unpacked)
    assert summary["packing_token_saving"] == pytest.approx(1 - slots / unpacked, abs=1e-4)
    # packed, a step computes exactly the tokens of its 4 examples (the batches the SFT loader hands out)
    cfg = _cfg(tmp_path / "packed", tiny_model_dir, **settings)
    loader = sft._train_loader(sft.build_dataset(cfg, load_tokenizer(tiny_model_dir), cfg.data.train_files), cfg)
    assert slots == sum(len(item["input_ids"]) for _ in range(3) for item in loader.next_batch()) < unpacked


def test_a_lora_run_checkpoints_its_adapters_and_resumes_exactly(
        tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With model.lora_rank the checkpoint's model/ holds the merged model and lora_adapter/; resuming loads the
    adapters (not the merged weights), so the resumed run ends on the uninterrupted run's adapters exactly."""
    from safetensors.torch import load_file

    from archer.models.lora import ADAPTER_DIR, ADAPTER_WEIGHTS

    settings = {"trainer.save_freq": 2, "model.lora_rank": 4, "model.lora_alpha": 8, "optim.lr": 0.01,
                "model.enable_gradient_checkpointing": False}
    whole = run_sft(_cfg(tmp_path / "whole", tiny_model_dir, **settings))
    cfg = _cfg(tmp_path / "cut", tiny_model_dir, **settings)
    _run_until_interrupted_in_step(cfg, 4, monkeypatch)
    saved = tmp_path / "cut" / "run" / "checkpoints" / "global_step_2" / "model"
    assert (saved / ADAPTER_DIR / ADAPTER_WEIGHTS).is_file() and (saved / "model.safetensors").is_file()
    monkeypatch.undo()
    resumed = run_sft(cfg)
    keys = ("step", "train/loss", "train/lr", "train/grad_norm")
    assert [{k: m[k] for k in keys} for m in _metrics(tmp_path / "cut" / "run")] == \
        [{k: m[k] for k in keys} for m in _metrics(tmp_path / "whole" / "run")]
    expected, got = (load_file(str(folder / ADAPTER_DIR / ADAPTER_WEIGHTS)) for folder in (whole, resumed))
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


def test_sft_visits_examples_in_the_order_torch_dataloader_did() -> None:
    """The resumable SFT loader keeps the order that archer's SFT had with a seeded torch DataLoader, epoch after
    epoch, so the same seed still gives the same warm start."""
    from torch.utils.data import DataLoader

    from archer.trainer.sft import torch_dataloader_order

    for n, batch, seed in ((1500, 32, 1), (50, 8, 3)):
        loader = DataLoader(list(range(n)), batch_size=batch, shuffle=True, drop_last=True,
                            generator=torch.Generator().manual_seed(seed), collate_fn=lambda items: items)
        for epoch in range(3):
            seen = [i for b in loader for i in b]
            assert seen == torch_dataloader_order(n, seed, epoch)[:len(seen)].tolist()
