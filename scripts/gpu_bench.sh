#!/usr/bin/env bash
# Every kernel benchmark in one device call (carry .whl for fla); each step has its own time limit and the run
# goes on after a failure; the step limits add up to 580 s, under the device tool's 600 s per command.
# Usage: bash scripts/gpu_bench.sh OUT_DIR [--sweep]
set -u
out=${1:-/tmp/gpu_bench}
sweep=${2:-}
mkdir -p "$out"
step() {  # name seconds command...
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" env PYTHONUNBUFFERED=1 "$@" > "$out/$name.log" 2>&1
  echo "rc=$?"; grep -v -i "warn" "$out/$name.log" | tail -8
}
# One process per prefill case: compiling ours and fla's for several cases in one process ran past 170 s on a
# fresh machine. --trace prints the kernel GPU times of fla and of each of our configurations.
# Each case times the dispatched configuration; scripts/sweep_prefill.py times each kernel under others.
step prefill_kda1 150 python3 scripts/bench_prefill.py --case kda1 --iters 10 --trace "$out/trace" --json "$out/prefill_kda1.json"
step prefill_gdn1 90 python3 scripts/bench_prefill.py --case gdn1 --iters 10 --trace "$out/trace" --json "$out/prefill_gdn1.json"
step prefill_gdn8 90 python3 scripts/bench_prefill.py --case gdn8 --iters 10 --trace "$out/trace" --json "$out/prefill_gdn8.json"
step mamba_conv 100 python3 scripts/bench_mamba_conv.py --no-sweep --segments 8 32 --json "$out/mamba_conv.json"
step decode 40 python3 scripts/sweep_decode.py --config 64,4,1,1,1 --json "$out/decode.json"
step attention_decode 55 python3 scripts/bench_attention.py $sweep --json "$out/attention_decode.json"
step attention_prefill 55 python3 scripts/bench_attention_prefill.py --mgpu --json "$out/attention_prefill.json"
rm -rf "$out"/trace*
