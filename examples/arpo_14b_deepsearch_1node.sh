#!/usr/bin/env bash
# ARPO's 14B deep-search run (its scripts/ARPO_14b_Deepsearch_1node.sh): the reasoning run's recipe on ARPO's hard
# search data (hard_search_1k.parquet; validation on GAIA and HLE), 12 responses per prompt (6 global samples),
# 2000 prompt + 6192 response tokens, 5 epochs, batch 64 / mini-batch 8, ARPO's deep-research reward.
# Hardware: as ARPO, one node of 8 x 80 GB GPUs (N_GPUS_PER_NODE=8, the default; README "Many GPUs"). On one
# 80 GB GPU (N_GPUS_PER_NODE=1) a 14B model needs LoRA and offload (README "Memory").
# Every variable below can be set from the environment; KEY=VALUE arguments are appended (the last value wins).
set -euo pipefail

ARPO_DIR=${ARPO_DIR:-${HOME}/ARPO}
export PROJECT_NAME=${PROJECT_NAME:-deep_research}
export EXPERIMENT_NAME=${EXPERIMENT_NAME:-qwen3_sft5.4w_global_16_init_8_beam_2_random_0.5_14B}
export MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3-14B}
export TRAIN_FILES=${TRAIN_FILES:-${ARPO_DIR}/rl_datasets/hard_search_1k.parquet}
export VAL_FILES=${VAL_FILES:-[${ARPO_DIR}/rl_datasets/gaia_test.parquet,${ARPO_DIR}/rl_datasets/hle_test.parquet]}
export SAVE_PATH=${SAVE_PATH:-./checkpoints/rl/${EXPERIMENT_NAME}}
export TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-64}
export PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE:-8}
export MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-2000}
export MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-6192}
export ROLLOUT_N=${ROLLOUT_N:-12}
export INITIAL_ROLLOUTS=${INITIAL_ROLLOUTS:-6}
export ARPO_DIR

bash "$(dirname "$0")/arpo_7b_reasoning_1node.sh" \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    trainer.total_epochs=5 \
    "$@"
