#!/usr/bin/env bash
# Archer2.0's entropy-trace run (run_archer2.0_qwen2.5_1.5b_math_entropy_trace.sh): the math run for 100 steps,
# one PPO epoch, with the per-token entropy of every step written to <run>/entropy_trace (archer viz reads it).
# Hardware: as archer2_math_1.5b.sh (2 GPUs by default); the trace release (doub7e/token-influence) ran it
# on one node of 8 GPUs: N_GPUS_PER_NODE=8. Variables and appended KEY=VALUE
# arguments: as there.
set -euo pipefail
EXPERIMENT_NAME=${EXPERIMENT_NAME:-Archer2.0-Qwen2.5-1.5B-Math-EntropyTrace}
CKPTS_DIR=${CKPTS_DIR:-./output/Archer2.0/${EXPERIMENT_NAME}}
export EXPERIMENT_NAME CKPTS_DIR

bash "$(dirname "$0")/archer2_math_1.5b.sh" \
    actor_rollout_ref.actor.ppo_epochs=1 \
    trainer.total_epochs=1 \
    trainer.total_training_steps=100 \
    trainer.entropy_trace.enable=True \
    trainer.entropy_trace.output_dir="${CKPTS_DIR}/entropy_trace" \
    "$@"
