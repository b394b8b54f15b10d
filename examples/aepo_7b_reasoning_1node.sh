#!/usr/bin/env bash
# AEPO (entropy-balanced agentic RL) on ARPO's 7B reasoning setup: the ARPO run with archer's aepo preset
# (archer/config/algorithm/aepo.yaml): dynamic entropy-balanced rollouts (a probe per prompt sets its global
# samples), the consecutive-branch penalty 0.05, entropy-balanced clipping and entropy-aware advantages.
# Hardware, data and variables: as arpo_7b_reasoning_1node.sh.
set -euo pipefail
export EXPERIMENT_NAME=${EXPERIMENT_NAME:-AEPO_global_16_init_8_beam_2}

bash "$(dirname "$0")/arpo_7b_reasoning_1node.sh" algorithm=aepo "$@"
