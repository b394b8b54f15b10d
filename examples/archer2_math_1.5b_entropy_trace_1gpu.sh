#!/usr/bin/env bash
# Archer2.0's one-GPU entropy-trace run (its "EntropyTrace-v9"): the entropy-trace run shrunk to fit one small
# GPU: 2 prompts x 1 response per step, 128 prompt + 64 response tokens, 100 steps, no validation or saving.
# Hardware: one GPU (24 GB is enough at these sizes); Archer2.0 also offloaded FSDP parameters and optimizer
# state, which archer accepts without effect (it needs no offload at this size).
# Variables and appended KEY=VALUE arguments: as archer2_math_1.5b.sh.
set -euo pipefail
EXPERIMENT_NAME=${EXPERIMENT_NAME:-Archer2.0-Qwen2.5-1.5B-Math-EntropyTrace-v9}
TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-2}
PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE:-2}
ROLLOUT_N=${ROLLOUT_N:-1}
MICRO_BATCH_SIZE_PER_GPU=${MICRO_BATCH_SIZE_PER_GPU:-2}  # the whole mini-batch (2 x 1 responses): verl refuses more
VAL_N=${VAL_N:-1}
MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-128}
MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-64}
export EXPERIMENT_NAME TRAIN_BATCH_SIZE PPO_MINI_BATCH_SIZE ROLLOUT_N MICRO_BATCH_SIZE_PER_GPU VAL_N MAX_PROMPT_LENGTH MAX_RESPONSE_LENGTH

bash "$(dirname "$0")/archer2_math_1.5b_entropy_trace.sh" \
    trainer.n_gpus_per_node=1 \
    trainer.save_freq=-1 \
    trainer.test_freq=-1 \
    trainer.total_epochs=1 \
    trainer.total_training_steps=100 \
    actor_rollout_ref.rollout.max_num_batched_tokens=256 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.2 \
    actor_rollout_ref.actor.fsdp_config.param_offload=True \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=True \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    "$@"
