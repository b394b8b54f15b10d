#!/usr/bin/env bash
# Archer2.0's Qwen2.5-1.5B math run (its scripts/train/run_archer2.0_qwen2.5_1.5b_math.sh) as an archer command:
# GRPO advantages with the ASPO loss (Archer2.0's use_archer_policy_loss=True), entropy split at the 0.8 quantile,
# clip 0.2 on low- and 0.4 on high-entropy tokens, KL loss 0.001, 3 PPO epochs, overlong buffer of 16 tokens,
# rejection of all-correct / all-wrong groups.
# Hardware: as Archer2.0, one node of 2 x 80 GB GPUs (N_GPUS_PER_NODE=2, the default; NNODES=2 for two nodes of a
# Ray cluster, README "Many GPUs"). One 80 GB GPU holds this 1.5B run at these sizes when the engine frees its
# memory for the update and takes 0.6 of the card to generate (archer's memory plan: at most 71.7 GiB of 79.2;
# the published settings keep the engine's 55 GiB through the update, 91.7 GiB on one card):
# N_GPUS_PER_NODE=1 FREE_CACHE_ENGINE=True GPU_MEMORY_UTILIZATION=0.6 bash examples/archer2_math_1.5b.sh
# A checkpoint of either continues under the other (devices and memory settings may change within a run).
# Data: Archer2.0's math set (Hugging Face Fate-Zero/Archer2.0-Math-1.5B) as verl parquet/json rows with
# data_source "math" and reward_model.ground_truth (archer reads .parquet, .json and .jsonl).
# Every variable below can be set from the environment; KEY=VALUE arguments are appended (the last value wins).
set -euo pipefail

PROJECT_NAME=${PROJECT_NAME:-Archer2.0}
EXPERIMENT_NAME=${EXPERIMENT_NAME:-Archer2.0-Qwen2.5-1.5B-Math}
MODEL_PATH=${MODEL_PATH:-deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B}
N_GPUS_PER_NODE=${N_GPUS_PER_NODE:-2}
NNODES=${NNODES:-1}
TRAIN_FILES=${TRAIN_FILES:-./data/train/archer2.0-math-1.5b-train.parquet}
VAL_FILES=${VAL_FILES:-./data/test/archer2.0-math-1.5b-val.parquet}
CKPTS_DIR=${CKPTS_DIR:-./output/${PROJECT_NAME}/${EXPERIMENT_NAME}}
LOGGER=${LOGGER:-[console,wandb]}
MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-1024}
MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-1024}
TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-64}
GEN_BATCH_SIZE=${GEN_BATCH_SIZE:-${TRAIN_BATCH_SIZE}}
PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE:-16}
MICRO_BATCH_SIZE_PER_GPU=${MICRO_BATCH_SIZE_PER_GPU:-8}
ROLLOUT_N=${ROLLOUT_N:-8}
VAL_N=${VAL_N:-4}
GPU_MEMORY_UTILIZATION=${GPU_MEMORY_UTILIZATION:-0.7}
FREE_CACHE_ENGINE=${FREE_CACHE_ENGINE:-False}
MAX_TOKEN_LEN=$((MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH))

archer train \
    data.train_files="${TRAIN_FILES}" \
    data.val_files="${VAL_FILES}" \
    data.prompt_key=prompt \
    data.filter_overlong_prompts=True \
    data.truncation=error \
    data.max_prompt_length=${MAX_PROMPT_LENGTH} \
    data.max_response_length=${MAX_RESPONSE_LENGTH} \
    data.dataloader_num_workers=1 \
    data.gen_batch_size=${GEN_BATCH_SIZE} \
    data.train_batch_size=${TRAIN_BATCH_SIZE} \
    actor_rollout_ref.rollout.n=${ROLLOUT_N} \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=False \
    algorithm.kl_ctrl.kl_coef=0.0 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.clip_ratio_low=0.2 \
    actor_rollout_ref.actor.clip_ratio_high=0.2 \
    actor_rollout_ref.actor.clip_ratio_c=3.0 \
    actor_rollout_ref.actor.policy_loss.loss_mode=aspo \
    actor_rollout_ref.actor.token_entropy_quantile=0.8 \
    actor_rollout_ref.actor.high_entropy_kl_loss_scale_coef=0.0 \
    actor_rollout_ref.actor.low_entropy_clip_ratio_low=0.2 \
    actor_rollout_ref.actor.low_entropy_clip_ratio_high=0.2 \
    actor_rollout_ref.actor.high_entropy_clip_ratio_low=0.4 \
    actor_rollout_ref.actor.high_entropy_clip_ratio_high=0.4 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.use_dynamic_bsz=False \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=${MICRO_BATCH_SIZE_PER_GPU} \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1 \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=${MAX_TOKEN_LEN} \
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=${MAX_TOKEN_LEN} \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=${MAX_TOKEN_LEN} \
    actor_rollout_ref.model.path="${MODEL_PATH}" \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.optim.lr_warmup_steps=10 \
    actor_rollout_ref.actor.optim.weight_decay=0.1 \
    actor_rollout_ref.actor.ppo_epochs=3 \
    actor_rollout_ref.actor.ppo_mini_batch_size=${PPO_MINI_BATCH_SIZE} \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.grad_clip=1.0 \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    actor_rollout_ref.rollout.gpu_memory_utilization=${GPU_MEMORY_UTILIZATION} \
    actor_rollout_ref.rollout.enforce_eager=False \
    actor_rollout_ref.rollout.free_cache_engine=${FREE_CACHE_ENGINE} \
    actor_rollout_ref.rollout.max_num_batched_tokens=${MAX_TOKEN_LEN} \
    actor_rollout_ref.rollout.max_model_len=${MAX_TOKEN_LEN} \
    actor_rollout_ref.rollout.temperature=1.0 \
    actor_rollout_ref.rollout.top_p=1.0 \
    actor_rollout_ref.rollout.top_k=-1 \
    actor_rollout_ref.rollout.val_kwargs.temperature=0.6 \
    actor_rollout_ref.rollout.val_kwargs.top_p=0.95 \
    actor_rollout_ref.rollout.val_kwargs.top_k=-1 \
    actor_rollout_ref.rollout.val_kwargs.do_sample=True \
    actor_rollout_ref.rollout.val_kwargs.n=${VAL_N} \
    reward_model.overlong_buffer.enable=True \
    reward_model.overlong_buffer.len=16 \
    reward_model.overlong_buffer.penalty_factor=1.0 \
    trainer.logger="${LOGGER}" \
    trainer.project_name="${PROJECT_NAME}" \
    trainer.experiment_name="${EXPERIMENT_NAME}" \
    trainer.n_gpus_per_node=${N_GPUS_PER_NODE} \
    trainer.nnodes=${NNODES} \
    trainer.balance_batch=False \
    trainer.val_before_train=False \
    trainer.test_freq=20 \
    trainer.save_freq=20 \
    trainer.total_epochs=2 \
    trainer.default_local_dir="${CKPTS_DIR}" \
    trainer.resume_mode=auto \
    trainer.validation_data_dir="${CKPTS_DIR}/eval" \
    trainer.rejection_sample=True \
    "$@"
