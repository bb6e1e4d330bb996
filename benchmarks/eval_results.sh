#!/usr/bin/env bash
# Runs `headsteer eval` for every method on every task it applies to (embedded model, test
# split) into results/, then prints the README's Results table. Usage: benchmarks/eval_results.sh [LIMIT]
set -euo pipefail
cd "$(dirname "$0")/.."
HS=.venv/bin/headsteer
LIMIT=${1:-}
mkdir -p results
run() {  # task method
  local out="results/$1.$2.csv"
  [ -s "$out" ] && return 0
  $HS --quiet eval --task "$1" --method "$2" --split test ${LIMIT:+--limit "$LIMIT"} --out "$out" --force >/dev/null
  echo "done $1 / $2" >&2
}
for task in json_format pronoun_change occupation counterfact; do
  for method in none pasta spotlight instaboost act; do run "$task" "$method"; done
done
for method in none act caa; do run sentiment "$method"; done
for method in none pasta spotlight instaboost act caa var vhr; do run context_qa "$method"; done
for task in counterfact occupation; do run "$task" caa; done
for task in counterfact occupation; do
  for method in var vhr; do run "$task" "$method"; done
done
.venv/bin/python benchmarks/results_table.py results
