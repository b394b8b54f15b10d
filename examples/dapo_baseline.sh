#!/usr/bin/env bash
# The DAPO baseline of ARPO's comparisons: ARPO's 7B reasoning setup (same data, tools, sizes) trained with
# archer's dapo preset (clip-higher 0.2/0.28, token-mean, dynamic sampling on acc, overlong buffer, dual-clip 10,
# -1 for a wrong answer) and no branching: all 16 responses of a prompt are global samples.
# Hardware, data and variables: as arpo_7b_reasoning_1node.sh.
set -euo pipefail
export EXPERIMENT_NAME=${EXPERIMENT_NAME:-DAPO_baseline_16}
export INITIAL_ROLLOUTS=${INITIAL_ROLLOUTS:-${ROLLOUT_N:-16}}
export BEAM_SIZE=1

bash "$(dirname "$0")/arpo_7b_reasoning_1node.sh" algorithm=dapo \
    reward_model.overlong_buffer.len=$((${MAX_RESPONSE_LENGTH:-4096} / 4)) "$@"
