"""Times archer's RL step on a randomly initialised model of a real size (Qwen2.5-0.5B's shape by default).

No weights can be downloaded here, so the model is random: the figures are the cost of the loop (generation,
log-probs, update), not learning. Prints one JSON line per training step from metrics.jsonl.

    python bench/gpu_step.py --out runs/bench_gpu_step --steps 3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from archer.data.tasks import write_task_files
from archer.models.loading import load_tokenizer
from archer.models.tiny import build_tiny_model

QWEN_VOCAB = 151936  # the rows of Qwen2.5's embedding and LM head
LLAMA_VOCAB = 128256  # LLaMA 3.1's
SHAPES = {  # hidden, layers, heads, kv heads, intermediate
    "tiny": (64, 2, 4, 2, 128),  # for trying a bench on a CPU
    "qwen2.5-0.5b": (896, 24, 14, 2, 4864),
    "qwen2.5-1.5b": (1536, 28, 12, 2, 8960),
    "qwen2.5-3b": (2048, 36, 16, 2, 11008),
    "qwen2.5-7b": (3584, 28, 28, 4, 18944),
    "llama-3.1-8b": (4096, 32, 32, 8, 14336),
}
UNTIED = ("qwen2.5-7b", "llama-3.1-8b")  # shapes whose LM head is not the embedding
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def build_random_model(out: Path, shape: str, vocab_size: int | None = None, *, dtype: torch.dtype | None = None,
                       device: str = "cpu") -> Path:
    """A randomly initialised model of ``shape`` with a BPE tokenizer trained on arithmetic-like text.

    ``vocab_size`` pads the embedding and LM head to that many rows (``QWEN_VOCAB`` as Qwen does: the rows
    past the tokenizer's decode to nothing); None gives them the tokenizer's size. Qwen2 shapes, and LLaMA 3.1's
    (its rope scaling, an untied head). ``dtype`` (default float32) is what the folder stores; ``device`` where
    the weights are drawn (a GPU draws billions of them in a second).
    """
    texts = [f"Compute {i}+{i + 1}-{i + 2}. The answer is {i - 1}." for i in range(2000)]
    tokenizer = load_tokenizer(build_tiny_model(out / "tokenizer_model", texts))
    hidden, layers, heads, kv, inter = SHAPES[shape]
    common = {"vocab_size": vocab_size or len(tokenizer), "hidden_size": hidden, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": inter,
              "max_position_embeddings": 32768, "tie_word_embeddings": shape not in UNTIED,  # Qwen2.5-0.5B-3B's
              "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
              "pad_token_id": tokenizer.pad_token_id}
    if shape.startswith("llama"):
        common["max_position_embeddings"] = 131072  # LLaMA 3.1's, beyond the scaled rope's 8192
        config, model_class = LlamaConfig(**common, rope_parameters=LLAMA3_ROPE), LlamaForCausalLM
    else:
        config, model_class = Qwen2Config(**common), Qwen2ForCausalLM
    model_dir = out / shape
    with torch.device(device):
        model = model_class(config)
    model.to(dtype or torch.float32).save_pretrained(model_dir)
    del model
    if torch.device(device).type == "cuda":  # the run that loads it is another process: give the card back
        torch.cuda.empty_cache()
    tokenizer.save_pretrained(model_dir)
    return model_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_gpu_step"))
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--response-length", type=int, default=256)
    args = parser.parse_args()
    files = write_task_files("arithmetic", args.out / "data", n_train=1000, n_val=64, n_sft=10, seed=0)
    model_dir = build_random_model(args.out, args.shape)
    run = args.out / "run"
    cmd = [sys.executable, "-m", "archer.cli", "train", f"actor_rollout_ref.model.path={model_dir}",
           f"data.train_files={files['train']}", f"data.val_files={files['val']}", "algorithm.adv_estimator=grpo",
           f"data.train_batch_size={args.batch}", f"actor_rollout_ref.rollout.n={args.n}",
           f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch // 2}",
           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32", "data.max_prompt_length=64",
           f"data.max_response_length={args.response_length}", "actor_rollout_ref.actor.use_kl_loss=true",
           f"trainer.total_training_steps={args.steps}", "trainer.val_before_train=false",
           f"trainer.default_local_dir={run}", "trainer.resume_mode=disable", "trainer.logger=[console,jsonl]"]
    subprocess.run(cmd, check=True)
    for line in (run / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        keep = {k: round(v, 3) for k, v in m.items() if k.startswith(("timing_s/", "perf/", "response_length/mean"))}
        print(json.dumps({"step": m["step"], **keep}))


if __name__ == "__main__":
    main()
