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
# SHAPE (default qwen2.5-0.5b; GVT_SHAPES for several grpo_vs_trl shapes) and GVT_STEPS / TRL_STEPS / TC_STEPS
# change the workload; STAGES (default all: "grpo_vs_trl quickstart influence_cost trace_cost trace_cost_grpo
# logprob_memory padding_free gpu_tests") picks stages (also gpu_memory and model_sizes: issue 14's GPU test and
# bench/model_sizes.py; stage_mfu, decode and archer2_recipe: issue 26's figures; agentic_rollout: issue 24's
# bench/agentic_rollout.py, which reads ARPO's prompts from AR_PROMPTS, default bench_data/arpo_prompts.json:
# make it with `python bench/agentic_rollout.py --export-prompts FILE` where ARPO's data is, as the device cannot
# read it), which run in the order STAGES names them; every stage has its own time limit (*_TIMEOUT), so one that
# hangs leaves the others their time.
# Issue 26's two calls on one H100:
#   STAGES="gpu_tests stage_mfu decode" bash bench/device_suite.sh
#   STAGES=grpo_vs_trl GVT_SHAPES="qwen2.5-0.5b qwen2.5-1.5b" GVT_STEPS=3 TRL_STEPS=2 bash bench/device_suite.sh
# and on two: STAGES=archer2_recipe bash bench/device_suite.sh (needs ray among the wheels)
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
    grpo_vs_trl)  # GVT_SHAPES (default SHAPE) names the shapes, each with TRL in the same call; TRL above 0.5B
      # runs with gradient checkpointing (its default): without it TRL's 1.5B runs out of memory on 80 GB
      for s in ${GVT_SHAPES:-$shape}; do
        trl_gc=$([ "$s" = qwen2.5-0.5b ] || echo --trl-gradient-checkpointing)
        stage "grpo_vs_trl $s" "${GVT_TIMEOUT:-330}" python3 bench/grpo_vs_trl.py --out "/tmp/gvt_$s" --shape "$s" \
          --steps "${GVT_STEPS:-4}" --trl-steps "${TRL_STEPS:-3}" --json "$out/grpo_vs_trl_$s.json" $trl_gc
        cp "/tmp/gvt_$s/archer_run/metrics.jsonl" "$out/grpo_vs_trl_archer_metrics_$s.jsonl" 2>/dev/null
      done ;;
    stage_mfu)  # issue 26: per-stage MFU / HBM fraction, padded against packed, 0.5B and 1.5B
      stage stage_mfu "${SM_TIMEOUT:-240}" python3 bench/stage_mfu.py --json "$out/stage_mfu.json" ${SM_ARGS:-} ;;
    decode)  # issue 26: the fast engine alone at 64, 128 and 512 rows for 0.5B and 1.5B, with its HBM fraction
      for s in qwen2.5-0.5b qwen2.5-1.5b; do
        for rows in 64 128 512; do
          stage "decode $s $rows" 60 python3 bench/rollout_throughput.py --shape "$s" --batch "$rows" --peers fast \
            --out "$out/decode.jsonl"
        done
      done ;;
    archer2_recipe)  # issue 26: the Archer2.0 recipe as published, step times on N_GPUS (default 2) GPUs
      stage archer2_recipe "${A2_TIMEOUT:-900}" python3 bench/archer2_recipe.py --gpus "${N_GPUS:-2}" \
        --steps "${A2_STEPS:-4}" --json "$out/archer2_recipe.json" ;;
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
      stage gpu_tests "${GT_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider tests/test_packing_gpu.py \
        tests/test_rollout_fast_gpu.py tests/test_rollout_fast_kernels.py tests/test_models_loading.py \
        tests/test_models_sequence_layout.py tests/test_rollout_factory.py tests/test_trace_influence.py ;;
    *) echo "=== unknown stage $1 (known: grpo_vs_trl quickstart influence_cost trace_cost trace_cost_grpo" \
         "logprob_memory padding_free gpu_memory model_sizes agentic_rollout gpu_tests stage_mfu decode" \
         "archer2_recipe)" ;;
  esac
}

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  python3 -m pip list 2>/dev/null | grep -iE '^(trl|datasets|accelerate|pyarrow|triton|hydra-core|omegaconf) '
  for name in $stages; do run_stage "$name"; done
} 2>&1 | tee "$out/suite.log"
