"""The warm-start workflow end to end: `archer sft` on a small sharegpt set with tool turns (function calls and
observations beside direct answers), then `archer eval` of its model on two benchmarks, whose greedy accuracy
goes from 0 (the base model) to 1 on the questions the SFT data answers."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import OmegaConf

from archer import cli
from archer.config.loader import CONFIG_DIR
from archer.trainer.sft import run_sft

SUMS = [(3, 4), (5, 2), (6, 1), (2, 2)]
DOUBLES = [7, 8, 9]
TOOL_ASKED = [(11, 12), (13, 14)]  # answered through a calculator call and its observation


def _conversation(question: str, answer: int, tool: bool) -> dict:
    turns = [{"from": "human", "value": question}]
    if tool:
        turns += [{"from": "function_call", "value": json.dumps({"name": "calculator",
                                                                 "arguments": {"expression": question[:-1]}})},
                  {"from": "observation", "value": str(answer)}]
    return {"conversations": [*turns, {"from": "gpt", "value": f"\\boxed{{{answer}}}"}],
            "tools": json.dumps([{"name": "calculator", "description": "evaluates an expression",
                                  "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}])}


def _benchmark(folder: Path, name: str, problems: list[tuple[str, int]]) -> str:
    (folder / f"{name}.jsonl").write_text("".join(json.dumps({"question": q, "answer": str(a)}) + "\n"
                                                  for q, a in problems))
    (folder / f"{name}.yaml").write_text(f"file: {name}.jsonl\ndata_source: archer/arithmetic\nprompt: '{{question}}'\n")
    return str(folder / f"{name}.yaml")


def _eval(model: Path, benchmarks: list[str], out: Path) -> dict:
    assert cli.main(["eval", f"model={model}", f"benchmark=[{','.join(benchmarks)}]", "max_response_length=12",
                     "max_prompt_length=64", f"output_dir={out}", "device=cpu"]) == 0
    return json.loads((out / "results.json").read_text())["metrics"]


def test_sft_on_a_sharegpt_tool_set_then_archer_eval_on_two_benchmarks(tiny_model_dir: Path, tmp_path: Path) -> None:
    sums = [(f"{a} + {b}?", a + b) for a, b in SUMS]
    doubles = [(f"{a} + {a}?", 2 * a) for a in DOUBLES]
    rows = [_conversation(q, a, tool=False) for q, a in sums + doubles]
    rows += [_conversation(f"{a} + {b}?", a + b, tool=True) for a, b in TOOL_ASKED]
    data = tmp_path / "tool_set.json"
    data.write_text(json.dumps(rows))
    cfg = OmegaConf.merge(OmegaConf.load(CONFIG_DIR / "sft_trainer.yaml"), OmegaConf.from_dotlist([
        f"data.train_files={data}", "data.max_length=160", f"data.train_batch_size={len(rows)}",
        "data.micro_batch_size_per_gpu=9", f"model.partial_pretrain={tiny_model_dir}",
        "model.enable_gradient_checkpointing=false", "optim.lr=1e-2", "optim.warmup_steps_ratio=0",
        "optim.lr_scheduler=constant", "trainer.total_training_steps=150", f"trainer.default_local_dir={tmp_path / 'sft'}",
        "trainer.logger=[jsonl]", "trainer.device=cpu", "trainer.plots=false"]))
    model = run_sft(cfg)
    benchmarks = [_benchmark(tmp_path, "sums", sums), _benchmark(tmp_path, "doubles", doubles)]
    before = _eval(tiny_model_dir, benchmarks, tmp_path / "eval_base")
    after = _eval(model, benchmarks, tmp_path / "eval_sft")
    for name in ("sums", "doubles"):
        assert before[f"val-core/{name}/acc/mean@1"] == 0.0
        assert after[f"val-core/{name}/acc/mean@1"] == 1.0
    samples = [json.loads(line) for line in (tmp_path / "eval_sft" / "samples.jsonl").read_text().splitlines()]
    assert {(s["benchmark"], s["samples"][0]["answer"]) for s in samples} == \
        {("sums", str(a)) for _, a in sums} | {("doubles", str(a)) for _, a in doubles}
