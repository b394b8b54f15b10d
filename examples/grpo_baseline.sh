#!/usr/bin/env bash
# The GRPO baseline of ARPO's comparisons: ARPO's 7B reasoning setup (same data, tools, sizes, KL loss 0) with
# plain GRPO rollouts: all 16 responses of a prompt are global samples, no branching.
# Hardware, data and variables: as arpo_7b_reasoning_1node.sh.
set -euo pipefail
export EXPERIMENT_NAME=${EXPERIMENT_NAME:-GRPO_baseline_16}
export INITIAL_ROLLOUTS=${INITIAL_ROLLOUTS:-${ROLLOUT_N:-16}}
export BEAM_SIZE=1

bash "$(dirname "$0")/arpo_7b_reasoning_1node.sh" "$@"
