#!/usr/bin/env bash
# Side by side: bench_generate.py on this tree with a patch applied against the same tree without it, in
# alternating processes on one machine (the method behind docs/BENCHMARKS.md's "side by side" figures: between
# processes and machines a step moves by 1-3%, so a variant is only compared with the base it alternates with).
#
# Usage: bash scripts/ab_generate.sh OUT_DIR DEADLINE_S "PATCH|ROUNDS|BENCH_ARGS" ["PATCH|ROUNDS|BENCH_ARGS" ...]
#   PATCH       a `git diff` of this tree (applied with patch -p1 to a copy of it)
#   ROUNDS      how many (variant, base) pairs of processes to run
#   BENCH_ARGS  bench_generate.py's arguments after the config directory, e.g.
#               "--placement all-attention pure-gdn --batch 1 2"
# Every process runs `bench_generate.py $CONFIG --defaults --prompt-len 1024 --output-len 128 --prefill-batch 1`
# (CONFIG: default ../shared/configs/apriel2-0.5b-shaped) with BENCH_ARGS. No process starts past DEADLINE_S
# seconds from the start, and each is cut off there (keep it under the device tool's 600 s per command). The
# last lines printed are a table: spec, variant, placement, batch, ms per step of each process in run order.
set -u
if [ $# -lt 3 ]; then
  sed -n 2,14p "$0"; exit 2
fi
out=$1; deadline=$2; shift 2
config=$(realpath "${CONFIG:-../shared/configs/apriel2-0.5b-shaped}")
start=$(date +%s)
mkdir -p "$out"
out=$(realpath "$out")
work=$(mktemp -d)
copy() {  # the tree as it is here (tracked and untracked files), without .git and a local .venv
  mkdir -p "$1" && tar -c --exclude=./.git --exclude=./.venv . | tar -x -C "$1"
}
copy "$work/base"
spec_no=0
for spec in "$@"; do
  IFS='|' read -r patch rounds args <<< "$spec"
  spec_no=$((spec_no + 1))
  name=$(basename "$patch" .patch)
  tree="$work/v$spec_no"
  copy "$tree"
  if ! patch -d "$tree" -p1 -s < "$patch"; then
    echo "spec $spec_no: $patch does not apply to this tree; skipped"; continue
  fi
  for round in $(seq "$rounds"); do
    for variant in "$name" base; do
      elapsed=$(( $(date +%s) - start ))
      if [ "$elapsed" -ge "$deadline" ]; then echo "deadline reached"; break 3; fi
      dir=$([ "$variant" = base ] && echo "$work/base" || echo "$tree")
      log="$out/ab${spec_no}_${variant}_$round.log"
      # shellcheck disable=SC2086
      (cd "$dir" && timeout $((deadline - elapsed)) python3 scripts/bench_generate.py "$config" --defaults \
        --prompt-len 1024 --output-len 128 --prefill-batch 1 $args --json "$out/ab${spec_no}_${variant}_$round.jsonl" \
        > "$log" 2>&1) || echo "spec $spec_no $variant round $round: exit $? (see $log)"
    done
  done
done
rm -rf "$work"
python3 - "$out" <<'PY'
import collections, glob, json, os, re, sys
steps = collections.defaultdict(list)
paths = glob.glob(os.path.join(sys.argv[1], "ab*_*.jsonl"))
for path in sorted(paths, key=lambda p: (int(re.search(r"ab(\d+)_", p)[1]), int(re.search(r"_(\d+)\.jsonl$", p)[1]))):
    spec, variant = re.match(r"ab(\d+)_(.+)_\d+\.jsonl$", os.path.basename(path)).groups()
    for line in open(path):
        row = json.loads(line)
        steps[(int(spec), variant, row["placement"], row["batch"])].append(row["step_ms"])
print("spec | variant | placement | batch | ms per step")
for (spec, variant, placement, batch), ms in sorted(steps.items()):
    print(f"{spec} | {variant} | {placement} | {batch} | {', '.join(f'{m:.3f}' for m in ms)}")
PY
