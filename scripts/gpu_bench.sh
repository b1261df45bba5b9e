#!/usr/bin/env bash
# Every kernel benchmark in one device call (carry .whl for fla); each step has its own time limit and the run
# goes on after a failure; the step limits add up to 590 s, under the device tool's 600 s per command.
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
step prefill 130 python3 scripts/bench_prefill.py --breakdown --iters 10 --json "$out/prefill.json"
step prefill_configs 110 python3 scripts/bench_prefill.py --case gdn8 --iters 10 --config 32,64,4,4,4 --config 64,64,4,4,4 --config 64,64,8,4,4 --config 64,64,4,4,4,1
step mamba_conv 80 python3 scripts/bench_mamba_conv.py --no-sweep --json "$out/mamba_conv.json"
step attention_decode 90 python3 scripts/bench_attention.py $sweep --json "$out/attention_decode.json"
step decode_fused 80 python3 scripts/bench_decode_fused.py --config 64,2,1 --config 64,4,1 --json "$out/decode_fused.json"
step attention_prefill 100 python3 scripts/bench_attention_prefill.py --mgpu --json "$out/attention_prefill.json"
