#!/usr/bin/env bash
# Correctness on the GPU with every Pallas kernel active (run through the device tool, carry .whl and .goldens):
# the engine's golden tests, its chained-decode tests and check_parity for every golden case and placement in
# float32. The runs go in parallel (compilation is most of their time; 16 CPU cores), each with a small share of
# GPU memory.
# Usage: bash scripts/gpu_validate.sh OUT_DIR [SECONDS]
set -u
out=${1:-/tmp/gpu_validate}
limit=${2:-400}
mkdir -p "$out"
export APRIEL2_GOLDENS=${APRIEL2_GOLDENS:-.goldens} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.04 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -c "import pallas_kernels, jax; print('kernels registered on', jax.devices()[0].device_kind)"
pids=()
# kernels the engine does not register by default, checked against their jnp oracles
timeout "$limit" python3 -m pytest -q -p no:cacheprovider tests/pallas_kernels/test_decode_mlp.py \
  > "$out/test_decode_mlp.log" 2>&1 &
pids+=($!)
# the Mosaic GPU gate/up, input-projection and down-projection kernels (registered) against their jnp ops, and the
# decode attention's split merge
for kernel_test in decode_gated_product decode_projections decode_matmul_add paged_attention_decode; do
  timeout "$limit" python3 -m pytest -q -p no:cacheprovider tests/pallas_kernels/test_$kernel_test.py \
    > "$out/test_$kernel_test.log" 2>&1 &
  pids+=($!)
done
# chained decode dispatches against one at a time (the carry read on the device), and chained prefill steps
timeout "$limit" python3 -m pytest -q -x -p no:cacheprovider tests/engine/test_llm.py \
  -k "(chained or stop_inside or abort_while or cannot_stop) and not prefill" > "$out/test_llm_chained.log" 2>&1 &
pids+=($!)
timeout "$limit" python3 -m pytest -q -x -p no:cacheprovider tests/engine/test_llm.py -k "chained_prefill" \
  > "$out/test_llm_chained_prefill.log" 2>&1 &
pids+=($!)
for case in "$APRIEL2_GOLDENS"/*/; do
  name=$(basename "$case")
  timeout "$limit" python3 -m pytest -q -x -p no:cacheprovider tests/engine/test_llm.py -k "$name" \
    > "$out/test_llm_$name.log" 2>&1 &
  pids+=($!)
  for placement in $(python3 -c "import json; print(' '.join(json.load(open('$case/placements.json'))))"); do
    timeout "$limit" python3 scripts/check_parity.py "$case" --placement "$placement" \
      > "$out/parity_${name}_$placement.log" 2>&1 &
    pids+=($!)
  done
done
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=$((failed + 1)); done
for log in "$out"/test_llm_*.log "$out"/test_decode_mlp.log "$out"/test_decode_gated_product.log \
  "$out"/test_decode_projections.log "$out"/test_decode_matmul_add.log "$out"/test_paged_attention_decode.log; do
  echo "$(basename "$log" .log): $(tail -1 "$log")"
done
for log in "$out"/parity_*.log; do
  echo "$(basename "$log" .log): $(grep -cE ' ok ' "$log") ok, $(grep -cE ' FAIL |Traceback' "$log") failed"
done
echo "runs failed: $failed"
