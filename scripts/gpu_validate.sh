#!/usr/bin/env bash
# Correctness on the GPU with every Pallas kernel active (run through the device tool, carry .whl and .goldens):
# the engine's golden tests, the kernel tests, and check_parity for every golden case in float32.
# Usage: bash scripts/gpu_validate.sh OUT_DIR
set -u
out=${1:-/tmp/gpu_validate}
mkdir -p "$out"
export APRIEL2_GOLDENS=${APRIEL2_GOLDENS:-.goldens} JAX_DEFAULT_MATMUL_PRECISION=highest
python3 -c "import pallas_kernels, jax; print('kernels registered on', jax.devices()[0].device_kind)"
timeout 240 env PYTHONUNBUFFERED=1 python3 -m pytest -q -x -p no:cacheprovider tests/engine/test_llm.py > "$out/test_llm.log" 2>&1
echo "engine golden tests (kernels active): rc=$? $(tail -1 "$out/test_llm.log")"
for case in ${CASES:-"$APRIEL2_GOLDENS"/*/}; do
  timeout 120 env PYTHONUNBUFFERED=1 python3 scripts/check_parity.py "$case" > "$out/parity_$(basename "$case").log" 2>&1
  echo "check_parity $(basename "$case"): rc=$?"
  grep -iE "fail|max" "$out/parity_$(basename "$case").log" | tail -3
done
