"""FSDP2 on a GPU: one rank of a process group (NCCL, bf16 compute over float32 master weights, the CPU offload
policy) against the plain single-device actor, on the micro model. CI has no GPU (skipped there); the device
runs it. What two ranks compute against one is tested on the CPU (tests/test_scale_out_on_cpu.py); this checks
the GPU-only parts: the nccl backend, mixed precision, the root's forward under autocast, the gathered stream into
the engine, and the distributed checkpoint of CUDA shards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SCRIPT = r'''
import json, sys, torch
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from workers_support import hand_batch, ppo_config
from archer.distributed.context import DistContext
from archer.models.lora import policy_weights
from archer.workers.actor import ActorWorker

model_dir, out = sys.argv[1], Path(sys.argv[2])
device = torch.device("cuda", 0)


def actor(ctx, *extra):
    cfg = ppo_config(model_dir, "actor_rollout_ref.actor.optim.weight_decay=0.0", "actor_rollout_ref.rollout.n=1",
                     "actor_rollout_ref.actor.optim.lr=1e-2",
                     "actor_rollout_ref.actor.ppo_mini_batch_size=3", "actor_rollout_ref.rollout.name=hf",
                     "actor_rollout_ref.rollout.response_length=4", *extra)
    return ActorWorker(cfg.actor_rollout_ref, device=device, total_steps=10, ctx=ctx)


def step(worker):
    batch = hand_batch()
    batch["old_log_probs"] = worker.compute_log_prob(batch)["old_log_probs"]
    batch["advantages"] = torch.tensor([[1.0, -0.5, 0.25], [0.5, 0.5, -1.0], [-0.25, 1.0, 0.75]])
    metrics = worker.update_actor(batch).metrics
    after = worker.compute_log_prob(batch)["old_log_probs"]
    prompts = hand_batch().select(["input_ids", "attention_mask", "position_ids"])
    prompts.info.update(validate=True, seed=1)
    generated = worker.generate_sequences(prompts)
    return batch["old_log_probs"], after, metrics, generated["responses"]


plain = step(actor(DistContext.single(device)))
ctx = DistContext.init_from_env("cuda", 120)
sharded_actor = actor(ctx, "actor_rollout_ref.actor.fsdp_config.param_offload=true")
sharded = step(sharded_actor)
sharded_actor.save(out / "ckpt", None)
names = sorted(p.name for p in (out / "ckpt" / "dcp").iterdir())
result = {
    "before": float((plain[0] - sharded[0]).abs().max()),
    "after": float((plain[1] - sharded[1]).abs().max()),
    "moved": float((plain[1] - plain[0]).abs().max()),
    "grad_norm": [plain[2]["actor/grad_norm"], sharded[2]["actor/grad_norm"]],
    "responses": [list(plain[3].shape), list(sharded[3].shape)],
    "engine_matches_policy": max(float((dict(policy_weights(sharded_actor.model))[name].to(tensor.dtype).cpu()
                                        - tensor.cpu()).abs().max())
                                 for name, tensor in sharded_actor.rollout.engine.model.named_parameters()),
    "dcp": names,
    "offloaded": str(next(sharded_actor.model.parameters()).to_local().device),
}
(out / "result.json").write_text(json.dumps(result))
ctx.destroy()
'''


def test_one_gpu_rank_with_fsdp2_computes_what_the_plain_actor_computes(tiny_model_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29531"}
    proc = subprocess.run([sys.executable, str(script), str(tiny_model_dir), str(tmp_path),
                           str(Path(__file__).parent)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    # bf16 compute on both sides; the sharded one casts float32 shards per layer (MixedPrecisionPolicy)
    assert result["before"] < 2e-2 and result["after"] < 2e-2, result
    assert result["moved"] > 5 * result["after"], result  # the update moved the log-probs far more than that
    assert result["grad_norm"][1] == pytest.approx(result["grad_norm"][0], rel=2e-2)
    assert result["responses"] == [[3, 4], [3, 4]], result  # 3 prompts x n=1, response_length 4
    assert result["engine_matches_policy"] == 0.0, result  # the standalone engine holds the gathered weights
    assert result["dcp"] == [".metadata", "__0_0.distcp"] and result["offloaded"] == "cpu", result
