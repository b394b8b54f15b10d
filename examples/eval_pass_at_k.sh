#!/usr/bin/env bash
# Evaluation as in ARPO's harness and Archer2.0's reports: sample N responses per problem (temperature 0.6, top-p
# 0.95) on the math and QA benchmarks and report unbiased pass@k for k in K (mean@n as well).
# Hardware: one GPU (a 7B model at 8 samples x 4096 tokens); CPU works for tiny models.
# Every variable below can be set from the environment; KEY=VALUE arguments are appended (the last value wins).
set -euo pipefail

MODEL_PATH=${MODEL_PATH:-./checkpoints/reasoning_tasks/ARPO_global_16_init_8_beam_2_random_0_arpo_0.2_entropy/checkpoints/latest}
BENCHMARKS=${BENCHMARKS:-[gsm8k,math500,aime24,hotpotqa,2wiki]}
N=${N:-8}
K=${K:-[1,4,8]}

archer eval \
    model="${MODEL_PATH}" \
    benchmark="${BENCHMARKS}" \
    n=${N} \
    k="${K}" \
    "$@"
