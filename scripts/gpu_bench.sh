#!/usr/bin/env bash
# The kernel benchmarks in two device calls (carry .whl for fla): PART is "prefill" (the three GDN/KDA prefill
# cases against fla) or "others" (Mamba/conv, decode update, paged attention). Each step has its own time limit
# and the run goes on after a failure; each part's limits add up to less than the device tool's 600 s per
# command (on a fresh machine the three prefill cases took up to ~200, ~90 and ~110 s: fla autotunes).
# PART "engine05b" / "engine15b": the serving engine on random weights of the 0.5B and 15B geometries (configs from
# $CONFIGS, default ../shared/configs; carry a copy when the device lacks it): decode steps, prefill with the
# engine's defaults, start-up from a cold and a warm compilation cache, and the 15B capacity benchmark.
# PART "tp_parity" / "tp_bench": tensor parallelism; "prefix" / "prefix15b": prefix caching (see below);
# "kv15b": time to first token of an 8K prefix loaded through the KV connector (host, disk) vs recomputed.
# PART "prefill05b": prefill with the defaults, prefill steps chained against one at a time.
# PART "profile05b": traces of the 0.5B decode steps, each top kernel named with its source lines; "ncu05b": Nsight
# Compute on one decode layer's kernels (scripts/profile_decode_kernels.py).
# Usage: bash scripts/gpu_bench.sh OUT_DIR prefill|others|engine05b|prefill05b|profile05b|ncu05b|engine15b|tp_parity|tp_bench|prefix|prefix15b|kv15b
set -u
out=${1:-/tmp/gpu_bench}
part=${2:-prefill}
sweep=${3:-}
mkdir -p "$out"
step() {  # name seconds command...
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" env PYTHONUNBUFFERED=1 "$@" > "$out/$name.log" 2>&1
  echo "rc=$?"; grep -v -i "warn" "$out/$name.log" | tail -8
}
if [ "$part" = prefill ]; then
  # One process per case: compiling ours and fla's for several cases in one process ran past 170 s on a fresh
  # machine. --trace prints the kernel GPU times of fla and of ours; each case times the dispatched configuration
  # (scripts/sweep_prefill.py times each kernel under others).
  step prefill_kda1 240 python3 scripts/bench_prefill.py --case kda1 --iters 10 --trace "$out/trace" --json "$out/prefill_kda1.json"
  step prefill_gdn1 150 python3 scripts/bench_prefill.py --case gdn1 --iters 10 --trace "$out/trace" --json "$out/prefill_gdn1.json"
  step prefill_gdn8 180 python3 scripts/bench_prefill.py --case gdn8 --iters 10 --trace "$out/trace" --json "$out/prefill_gdn8.json"
elif [ "$part" = others ]; then
  step mamba_conv 200 python3 scripts/bench_mamba_conv.py --no-sweep --segments 8 32 --json "$out/mamba_conv.json"
  step decode 80 python3 scripts/sweep_decode.py --config 64,4,1,1,1 --json "$out/decode.json"
  step attention_decode 140 python3 scripts/bench_attention.py $sweep --json "$out/attention_decode.json"
  step attention_prefill 140 python3 scripts/bench_attention_prefill.py --mgpu --json "$out/attention_prefill.json"
elif [ "$part" = engine05b ]; then
  configs=${CONFIGS:-../shared/configs}
  gen="python3 scripts/bench_generate.py $configs/apriel2-0.5b-shaped --defaults"
  step engine_05b 420 $gen --placement all-attention every2-kda a12-g1-k11 pure-gdn --batch 1 32 \
    --prompt-len 1024 --output-len 128 --prefill-batch 32 --json "$out/engine_05b.jsonl"
  # The same decode at the model's own max_model_len (the LLM default): block tables fitted to the context.
  step engine_05b_long 240 $gen --placement all-attention a12-g1-k11 --batch 1 32 --prompt-len 1024 \
    --output-len 128 --prefill-batch 1 --max-model-len 262144 --json "$out/engine_05b_long.jsonl"
  # First token with defaults (a12-g1-k11 compiled slowest): start_up_s + first_prefill_s, cold then warm cache.
  rm -rf "$out/xla_cache"
  for state in cold warm; do
    APRIEL2_JAX_CACHE_DIR="$out/xla_cache" step startup_$state 150 $gen --placement a12-g1-k11 --batch 1 \
      --prompt-len 1024 --output-len 8 --prefill-batch 1 --json "$out/startup_$state.jsonl"
  done
  rm -rf "$out/xla_cache"
elif [ "$part" = prefill05b ]; then
  # Prefill with the engine's defaults, chained prefill steps (the default) against one step at a time, in
  # alternating processes ($ROUNDS rounds, default 2); a table of prefill tok/s (device and wall) last.
  configs=${CONFIGS:-../shared/configs}
  gen="python3 scripts/bench_generate.py $configs/apriel2-0.5b-shaped --defaults --batch 1 --prompt-len 1024
    --output-len 2 --prefill-batch ${PREFILL_BATCH:-32}
    --placement ${PLACEMENTS:-all-attention every2-kda a12-g1-k11 pure-gdn}"
  for round in $(seq "${ROUNDS:-2}"); do
    step prefill05b_chained_$round 240 $gen --json "$out/prefill05b_chained.jsonl"
    step prefill05b_one_at_a_time_$round 240 $gen --no-chain-prefill --json "$out/prefill05b_one_at_a_time.jsonl"
  done
  python3 - "$out" <<'PY'
import json, os, sys
print(f"{'placement':<16} {'variant':<14} {'device tok/s':>13} {'wall tok/s':>11} {'chained':>8}")
for variant in ("chained", "one_at_a_time"):
    path = os.path.join(sys.argv[1], f"prefill05b_{variant}.jsonl")
    for row in (json.loads(line) for line in open(path)) if os.path.exists(path) else ():
        print(f"{row['placement']:<16} {variant:<14} {row['prefill_tok_s']:>13.0f} {row['prefill_wall_tok_s']:>11.0f} "
              f"{row.get('prefill_chained', '-'):>8}")
PY
elif [ "$part" = profile05b ]; then
  # Where the 0.5B decode steps' time goes: a trace per placement and batch, each top kernel named with the model
  # source lines it comes from (the step's optimized HLO is dumped under $out/hlo).
  configs=${CONFIGS:-../shared/configs}
  step profile05b 420 python3 scripts/bench_generate.py $configs/apriel2-0.5b-shaped --defaults \
    --placement ${PLACEMENTS:-all-attention every2-kda a12-g1-k11 pure-gdn} --batch 1 32 --prompt-len 1024 \
    --output-len 32 --prefill-batch 1 --trace --hlo-dir "$out/hlo"
  grep -E "^decode |^  busy|^ +[0-9.]+ us " "$out/profile05b.log" | head -200
elif [ "$part" = ncu05b ]; then
  # Nsight Compute on one decode layer's kernels at the 0.5B geometry (scripts/profile_decode_kernels.py) at $ROWS
  # (default "1 32") of $KINDS (default all): the one-row GEMV kernels, the decode attention and the Mosaic GPU
  # kernels, each call profiled with the full set of sections (stall sampling by source line included); the report
  # comes back, its details as text, the SASS lines' stall samples as CSV, and a short table of registers,
  # occupancy, waves, DRAM throughput and duration per kernel last.
  # Without preallocation: Nsight Compute saves and restores the memory a kernel may write between its replay
  # passes, and JAX's preallocated pool made that most of the run (400 s for six kernels, H200).
  XLA_PYTHON_CLIENT_PREALLOCATE=false step ncu05b 400 ncu --clock-control none --set full --import-source yes -f \
    -o "$out/decode_kernels" -k regex:'gemv|attention|_body' python3 scripts/profile_decode_kernels.py \
    --rows ${ROWS:-1 32} --kinds ${KINDS:-gemv attention mosaic}
  ncu -i "$out/decode_kernels.ncu-rep" --page details > "$out/ncu_details.txt" 2>&1
  ncu -i "$out/decode_kernels.ncu-rep" --page source --csv --print-source sass > "$out/ncu_source.csv" 2>&1
  grep -E "^  [a-z_]+.*\(|Registers Per Thread|Waves Per SM|Achieved Occupancy|DRAM Throughput|^    Duration" \
    "$out/ncu_details.txt"
elif [ "$part" = engine15b ]; then
  configs=${CONFIGS:-../shared/configs}
  gen="python3 scripts/bench_generate.py $configs/superapriel-15b-shaped --defaults"
  step engine_15b 270 $gen --placement all-attention reg-lklhd-10 --batch 8 --prompt-len 32768 --output-len 32 \
    --prefill-batch 1 --json "$out/engine_15b.jsonl"
  step capacity_15b 300 $gen --capacity --placement all-attention reg-lklhd-10 idealized-lklhd-6 \
    --prompt-len 32768 --output-len 256 --json "$out/capacity_15b.jsonl"
elif [ "$part" = tp_parity ]; then
  # Golden parity (float32) through the tensor-parallel path at each entry of $TPS (default $TP, else 1), one
  # process per case and size, all in parallel (carry .goldens), beside the engine's tensor-parallel tests at TP=2
  # (split caches, prefix caching, chained dispatches); then one line per run and the logs in one archive.
  tps=${TPS:-${TP:-1}}
  goldens=${APRIEL2_GOLDENS:-.goldens}
  export XLA_PYTHON_CLIENT_MEM_FRACTION=0.05 XLA_PYTHON_CLIENT_PREALLOCATE=false
  logs="$out/tp_parity_logs"; mkdir -p "$logs"
  for tp in $tps; do
    for case in "$goldens"/*/; do
      log="$logs/parity_tp${tp}_$(basename "$case").log"
      (timeout 400 env PYTHONUNBUFFERED=1 python3 scripts/check_parity.py "$case" --tensor-parallel "$tp" > "$log" 2>&1
       echo "rc=$?" >> "$log") &
    done
  done
  timeout 400 env PYTHONUNBUFFERED=1 APRIEL2_GOLDENS="$goldens" python3 -m pytest -q -p no:cacheprovider \
    tests/test_tensor_parallel.py -k "each_device or caches_are or prefix_caching or chained" \
    > "$logs/tp_tests.log" 2>&1 &
  wait
  for log in "$logs"/parity_*.log; do
    echo "$(basename "$log" .log): $(grep -cE ' ok ' "$log") ok, $(grep -cE ' FAIL |Traceback|^error:' "$log") failed, $(tail -1 "$log")"
  done
  echo "tp_tests: $(tail -1 "$logs/tp_tests.log")"
  tar czf "$out/tp_parity_logs.tgz" -C "$out" tp_parity_logs && rm -rf "$logs"
elif [ "$part" = tp_bench ]; then
  # The 15B decode/prefill and capacity at each entry of $TPS ("none": the one-device model), side by side, for
  # $PLACEMENTS at $BATCH rows (default 8; 4 fits one 80 GB H100 with all-attention at 32K); CAPACITY=0 skips the
  # capacity run, BENCH=0 the decode/prefill run; TRACE=1 adds each step's breakdown (collectives included, on the
  # first device).
  tps=${TPS:-none 1}
  configs=${CONFIGS:-../shared/configs}
  gen="python3 scripts/bench_generate.py $configs/superapriel-15b-shaped --defaults ${BENCH_ARGS:-}"
  placements=${PLACEMENTS:-all-attention reg-lklhd-10}
  trace=""; [ "${TRACE:-0}" = 1 ] && trace="--trace"
  if [ "${BENCH:-1}" = 1 ]; then
    step engine_15b_tp "${BENCH_LIMIT:-330}" $gen --placement $placements --batch "${BATCH:-8}" --prompt-len 32768 \
      --output-len 32 --prefill-batch 1 --tensor-parallel $tps $trace --json "$out/engine_15b_tp.jsonl"
  fi
  if [ "${CAPACITY:-1}" = 1 ]; then
    step capacity_15b_tp "${CAPACITY_LIMIT:-240}" $gen --capacity --placement $placements --prompt-len 32768 \
      --output-len 64 --tensor-parallel $tps --json "$out/capacity_15b_tp.jsonl"
  fi
elif [ "$part" = prefix ]; then
  # Prefix caching on the GPU: the golden tests (outputs identical with and without it on every case and
  # placement, float32, Pallas kernels; carry .goldens), then 64 prompts sharing a 4K prefix on the 0.5B.
  configs=${CONFIGS:-../shared/configs}
  step prefix_tests 240 env APRIEL2_GOLDENS="${APRIEL2_GOLDENS:-.goldens}" \
    python3 -m pytest -q -p no:cacheprovider tests/engine/test_prefix_cache.py
  step prefix_05b 330 python3 scripts/bench_generate.py $configs/apriel2-0.5b-shaped --shared-prefix 4096 \
    --suffix-len 256 --requests 64 --placement ${PLACEMENTS:-all-attention every2-kda a12-g1-k11 pure-gdn} \
    --json "$out/prefix_05b.jsonl"
elif [ "$part" = prefix15b ]; then
  configs=${CONFIGS:-../shared/configs}
  step prefix_15b 560 python3 scripts/bench_generate.py $configs/superapriel-15b-shaped --shared-prefix 4096 \
    --suffix-len 256 --requests 64 --placement ${PLACEMENTS:-all-attention reg-lklhd-10} \
    --json "$out/prefix_15b.jsonl"
elif [ "$part" = kv15b ]; then
  configs=${CONFIGS:-../shared/configs}
  step kv_15b 560 python3 scripts/bench_generate.py $configs/superapriel-15b-shaped --kv-prefix 8192 \
    --suffix-len 256 --placement ${PLACEMENTS:-all-attention reg-lklhd-10} --kv-path "$out/kv_store" \
    --json "$out/kv_15b.jsonl"
  rm -rf "$out/kv_store"
else
  echo "PART must be prefill, others, engine05b, prefill05b, profile05b, ncu05b, engine15b, tp_parity, tp_bench, prefix, prefix15b or kv15b, got '$part'" >&2
  exit 2
fi
rm -rf "$out"/trace*
