#!/usr/bin/env bash
# ARPO's cold-start SFT (its LLaMA-Factory arpo_train_sft/yaml/qwen.yaml) as an archer command: full fine-tuning on
# ShareGPT conversations ("conversations" column; tool results inside " <result>...</result>" get no loss),
# 15000 tokens per example, lr 7e-6 cosine with 10% warmup, 3 epochs, 16 examples per step (LLaMA-Factory:
# 1 per device x 2 accumulation x 8 GPUs).
# Hardware: ARPO ran it with DeepSpeed ZeRO-3 offload on 8 GPUs. archer trains on one device today: a 7B model
# fits one 80 GB GPU with gradient checkpointing only at shorter MAX_LENGTH; set MAX_LENGTH to what your card holds.
# Data: ARPO's SFT set (final_5w4_still.jsonl, ShareGPT) or any .json/.jsonl/.parquet of that shape.
# Every variable below can be set from the environment; KEY=VALUE arguments are appended (the last value wins).
set -euo pipefail

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-7B-Instruct}
TRAIN_FILES=${TRAIN_FILES:-./dataset/final_5w4_still.jsonl}
OUTPUT_DIR=${OUTPUT_DIR:-./checkpoints/qwen}
MAX_LENGTH=${MAX_LENGTH:-15000}
TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-16}
MICRO_BATCH_SIZE_PER_GPU=${MICRO_BATCH_SIZE_PER_GPU:-1}
LOGGER=${LOGGER:-[console,tensorboard]}

archer sft \
    model.partial_pretrain="${MODEL_PATH}" \
    model.trust_remote_code=true \
    model.enable_gradient_checkpointing=true \
    data.train_files="${TRAIN_FILES}" \
    data.multiturn.enable=true \
    data.multiturn.messages_key=conversations \
    data.max_length=${MAX_LENGTH} \
    data.truncation=right \
    data.train_batch_size=${TRAIN_BATCH_SIZE} \
    data.micro_batch_size_per_gpu=${MICRO_BATCH_SIZE_PER_GPU} \
    optim.lr=7e-6 \
    optim.lr_scheduler=cosine \
    optim.warmup_steps_ratio=0.1 \
    trainer.total_epochs=3 \
    trainer.logger="${LOGGER}" \
    trainer.default_local_dir="${OUTPUT_DIR}" \
    "$@"
