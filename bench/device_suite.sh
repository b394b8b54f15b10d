#!/usr/bin/env bash
# The GPU figures of issue 11 in device calls: archer's GRPO step against TRL's GRPOTrainer
# (bench/grpo_vs_trl.py, Qwen2.5-0.5B's shape), the quickstart on the GPU, the cost of the entropy and influence
# traces (bench/trace_cost.py on its own workload and on grpo_vs_trl's, bench/influence_cost.py), the log-prob
# kernel's memory (bench/logprob_memory.py), padded against padding-free micro-batches (bench/padding_free.py)
# and the CUDA tests. Logs and JSON go to $OUT (default ./suite_out), a few files: runs write under /tmp and
# the suite copies their summaries.
#
# Run from a folder holding archer/ and bench/ (the repo root, or a copy of both). Packages the machine lacks
# are installed from ./whl when it exists (bench/device_wheels.sh fills it):
#   bash bench/device_suite.sh
# SHAPE (default qwen2.5-0.5b) and GVT_STEPS / TRL_STEPS / TC_STEPS change the workload; STAGES (default all:
# "grpo_vs_trl quickstart influence_cost trace_cost trace_cost_grpo logprob_memory padding_free gpu_tests")
# picks stages (also gpu_memory and model_sizes: issue 14's GPU test and bench/model_sizes.py; agentic_rollout:
# issue 24's bench/agentic_rollout.py, which reads ARPO's prompts from AR_PROMPTS, default
# bench_data/arpo_prompts.json: make it with `python bench/agentic_rollout.py --export-prompts FILE` where ARPO's
# data is, as the device cannot read it), which run in the
# order STAGES names them; every stage has its own time limit, so one that hangs
# leaves the others their time.
set -uo pipefail
out=${OUT:-$PWD/suite_out}
shape=${SHAPE:-qwen2.5-0.5b}
stages=${STAGES:-grpo_vs_trl quickstart influence_cost trace_cost trace_cost_grpo logprob_memory padding_free gpu_tests}
mkdir -p "$out"
if [ -d whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site whl/*.whl
fi
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1

stage() {  # NAME SECONDS COMMAND...: runs COMMAND under a time limit and logs how it ended
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "=== $name: $*"
  timeout "$limit" "$@"
  echo "=== $name: exit $? after $((SECONDS - start)) s"
}

run_stage() {  # NAME: one stage of the suite
  case $1 in
    grpo_vs_trl)
      stage grpo_vs_trl 330 python3 bench/grpo_vs_trl.py --out /tmp/gvt --shape "$shape" \
        --steps "${GVT_STEPS:-4}" --trl-steps "${TRL_STEPS:-3}" --json "$out/grpo_vs_trl.json"
      cp /tmp/gvt/archer_run/metrics.jsonl "$out/grpo_vs_trl_archer_metrics.jsonl" 2>/dev/null ;;
    quickstart)
      stage quickstart 90 python3 -m archer.cli quickstart --out /tmp/qs
      cp /tmp/qs/summary.json "$out/quickstart_summary.json" 2>/dev/null ;;
    influence_cost)  # the hooks and scoring alone, at the trace_cost GPU step's shape (256 rows of 320)
      stage influence_cost 120 python3 bench/influence_cost.py --device cuda --dtype bfloat16 --shape "$shape" \
        --prompts 32 --micro 32 ;;
    trace_cost)
      stage trace_cost 150 python3 bench/trace_cost.py --out /tmp/tc --shape "$shape" --steps "${TC_STEPS:-4}"
      cp /tmp/tc/run_influence/metrics.jsonl "$out/trace_cost_influence_metrics.jsonl" 2>/dev/null ;;
    trace_cost_grpo)  # the same on bench/grpo_vs_trl.py's workload (16 x 8 responses of 512 tokens)
      stage trace_cost_grpo 240 python3 bench/trace_cost.py --out /tmp/tcg --shape "$shape" --grpo-workload \
        --steps "${TC_STEPS:-4}"
      cp /tmp/tcg/run_influence/metrics.jsonl "$out/trace_cost_grpo_influence_metrics.jsonl" 2>/dev/null ;;
    logprob_memory)  # 65536 tokens x 151936 vocabulary: the previous kernel against archer's
      stage logprob_memory 90 python3 bench/logprob_memory.py ;;
    padding_free)
      stage padding_free 120 python3 bench/padding_free.py --device cuda --shape "$shape" --rows 64 \
        --max-response 1024 --budget 16384 ;;
    gpu_memory)  # issue 14: 0.5B at defaults, 3 steps, with the caching allocator filled by an update first
      stage gpu_memory 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_memory.py ;;
    model_sizes)  # issue 14: 0.5B-8B shapes at their settings (MS_ROWS picks rows), TRL for 0.5B and 1.5B
      stage model_sizes "${MS_TIMEOUT:-560}" python3 bench/model_sizes.py --out /tmp/ms --json "$out/model_sizes.json" \
        --markdown "$out/model_sizes.md" --steps "${MS_STEPS:-6}" --trl-steps "${MS_TRL_STEPS:-6}" \
        ${MS_ROWS:+--rows $MS_ROWS} ${MS_ARGS:-} ;;
    agentic_rollout)
      stage agentic_rollout "${AR_TIMEOUT:-300}" python3 bench/agentic_rollout.py \
        --prompts-file "${AR_PROMPTS:-bench_data/arpo_prompts.json}" --json "$out/agentic_rollout.json" ${AR_ARGS:-} ;;
    gpu_tests)
      stage gpu_tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_rollout_fast_gpu.py \
        tests/test_rollout_fast_kernels.py tests/test_models_loading.py tests/test_rollout_factory.py \
        tests/test_trace_influence.py ;;
    *) echo "=== unknown stage $1 (known: grpo_vs_trl quickstart influence_cost trace_cost trace_cost_grpo" \
         "logprob_memory padding_free gpu_memory model_sizes agentic_rollout gpu_tests)" ;;
  esac
}

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  python3 -m pip list 2>/dev/null | grep -iE '^(trl|datasets|accelerate|pyarrow|triton|hydra-core|omegaconf) '
  for name in $stages; do run_stage "$name"; done
} 2>&1 | tee "$out/suite.log"
