#!/usr/bin/env bash
# ARPO's 7B reasoning run (its scripts/ARPO_7B_Reasoning_1node.sh) as an archer command: GRPO with ARPO's
# entropy-based branching (16 responses per prompt: 8 global samples, the rest branched after tool calls with
# beam 2, P(branch) = 0.5 + 0.2 * dH), ARPO's <python>/<search> tools (3 calls per response), 2 epochs.
# Hardware: as ARPO, one node of 8 x 80 GB GPUs (N_GPUS_PER_NODE=8, the default; NNODES for more nodes of a Ray
# cluster, README "Many GPUs"). On one 80 GB GPU (N_GPUS_PER_NODE=1) a 7B model with 1536 + 4096 tokens needs
# LoRA (actor_rollout_ref.model.lora_rank=64) and actor_rollout_ref.actor.fsdp_config.param_offload
# (README "GPU") or a smaller TRAIN_BATCH_SIZE.
# Data: ARPO's rl_datasets (train_10k.parquet, valid.parquet) and search_cache/search_cache.json; the search tool
# answers from that cache, and also from Bright Data's Bing API when BING_API_KEY is set (new results are written
# to SEARCH_CACHE, which must then be writable). REWARD_FILE: ARPO's deep_research.py (unset: archer's built-in
# routes, math -> math, QA -> deep research).
# Every variable below can be set from the environment; KEY=VALUE arguments are appended (the last value wins).
set -euo pipefail

ARPO_DIR=${ARPO_DIR:-${HOME}/ARPO}
PROJECT_NAME=${PROJECT_NAME:-reasoning_tasks}
EXPERIMENT_NAME=${EXPERIMENT_NAME:-ARPO_global_16_init_8_beam_2_random_0_arpo_0.2_entropy}
MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-7B-Instruct}
N_GPUS_PER_NODE=${N_GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
TRAIN_FILES=${TRAIN_FILES:-${ARPO_DIR}/rl_datasets/train_10k.parquet}
VAL_FILES=${VAL_FILES:-${ARPO_DIR}/rl_datasets/valid.parquet}
SEARCH_CACHE=${SEARCH_CACHE:-${ARPO_DIR}/search_cache/search_cache.json}
REWARD_FILE=${REWARD_FILE-${ARPO_DIR}/verl_arpo_entropy/verl/utils/reward_score/deep_research.py}
BING_API_KEY=${BING_API_KEY:-null}
SAVE_PATH=${SAVE_PATH:-./checkpoints/${EXPERIMENT_NAME}}
LOGGER=${LOGGER:-[console,wandb]}
TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-128}
PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE:-16}
MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-1536}
MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-4096}
ROLLOUT_N=${ROLLOUT_N:-16}
INITIAL_ROLLOUTS=${INITIAL_ROLLOUTS:-8}
BEAM_SIZE=${BEAM_SIZE:-2}
TOOLS=actor_rollout_ref.rollout.tools

archer train \
    algorithm.adv_estimator=grpo \
    algorithm.kl_ctrl.kl_coef=0.0 \
    data.train_files="${TRAIN_FILES}" \
    data.val_files="${VAL_FILES}" \
    data.prompt_key=prompt \
    data.train_batch_size=${TRAIN_BATCH_SIZE} \
    data.max_prompt_length=${MAX_PROMPT_LENGTH} \
    data.max_response_length=${MAX_RESPONSE_LENGTH} \
    actor_rollout_ref.model.path="${MODEL_PATH}" \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=${PPO_MINI_BATCH_SIZE} \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$((2 * (MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH))) \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.0 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=$((4 * (MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH))) \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.mode=sync_with_tool \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.7 \
    actor_rollout_ref.rollout.n=${ROLLOUT_N} \
    actor_rollout_ref.rollout.initial_rollouts=${INITIAL_ROLLOUTS} \
    actor_rollout_ref.rollout.beam_size=${BEAM_SIZE} \
    actor_rollout_ref.rollout.branch_probability=0.5 \
    actor_rollout_ref.rollout.entropy_weight=0.2 \
    ${TOOLS}.call_limit=3 \
    +${TOOLS}.tool_instances.python.class_path=verl.workers.rollout.tools.python_tool.PythonTool \
    +${TOOLS}.tool_instances.search.class_path=verl.workers.agent.tools.search_tool.BingSearchTool \
    +${TOOLS}.tool_instances.search.params.cache_file="${SEARCH_CACHE}" \
    +${TOOLS}.tool_instances.search.params.api_key=${BING_API_KEY} \
    +${TOOLS}.tool_instances.search.params.max_results=10 \
    +${TOOLS}.tool_instances.search.params.result_length=1000 \
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=$((4 * (MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH))) \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    reward_model.reward_manager=naive \
    ${REWARD_FILE:+custom_reward_function.path="${REWARD_FILE}"} \
    custom_reward_function.name=compute_score \
    trainer.critic_warmup=0 \
    trainer.logger="${LOGGER}" \
    trainer.project_name="${PROJECT_NAME}" \
    trainer.experiment_name="${EXPERIMENT_NAME}" \
    trainer.n_gpus_per_node=${N_GPUS_PER_NODE} \
    trainer.nnodes=${NNODES} \
    trainer.save_freq=5 \
    trainer.test_freq=5 \
    trainer.total_epochs=2 \
    trainer.default_local_dir="${SAVE_PATH}" \
    trainer.val_before_train=False \
    trainer.rollout_data_dir="${SAVE_PATH}/rollout" \
    "$@"
