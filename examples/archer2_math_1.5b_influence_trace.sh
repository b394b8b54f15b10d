#!/usr/bin/env bash
# Archer2.0's influence-trace run (run_archer2.0_qwen2.5_1.5b_math_influence_trace.sh): two steps of the math run
# with both traces: per-token entropy, and per-token influence on the accepted-vs-rejected direction from the
# update's own backward (o_proj and down_proj of the last hooked module, projections capped at 64 + 2500).
# Hardware: as archer2_math_1.5b.sh (2 x 80 GB GPUs by default, or one with its one-GPU settings); the trace
# release (doub7e/token-influence) ran it on one node of 8 GPUs: N_GPUS_PER_NODE=8. Variables and appended
# KEY=VALUE arguments: as there.
set -euo pipefail
EXPERIMENT_NAME=${EXPERIMENT_NAME:-Archer2.0-Qwen2.5-1.5B-Math-InfluenceTrace}
CKPTS_DIR=${CKPTS_DIR:-./output/Archer2.0/${EXPERIMENT_NAME}}
export EXPERIMENT_NAME CKPTS_DIR

bash "$(dirname "$0")/archer2_math_1.5b.sh" \
    actor_rollout_ref.actor.ppo_epochs=1 \
    trainer.total_epochs=1 \
    trainer.total_training_steps=2 \
    trainer.entropy_trace.enable=True \
    trainer.entropy_trace.output_dir="${CKPTS_DIR}/entropy_trace" \
    trainer.entropy_trace.write_every=1 \
    trainer.entropy_trace.fsync=False \
    trainer.influence_trace.enable=True \
    trainer.influence_trace.output_dir="${CKPTS_DIR}/influence_trace" \
    trainer.influence_trace.write_every=1 \
    trainer.influence_trace.fsync=False \
    trainer.influence_trace.max_prompts_per_step=2 \
    trainer.influence_trace.reg_lambda=-1.0 \
    trainer.influence_trace.module_name_filter='[self_attn.o_proj,mlp.down_proj]' \
    trainer.influence_trace.max_modules=1 \
    trainer.influence_trace.max_proj_vector_sum=64 \
    trainer.influence_trace.max_hessian_dim=2500 \
    "$@"
