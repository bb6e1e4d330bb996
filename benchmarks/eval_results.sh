#!/usr/bin/env bash
# Runs `headsteer eval` for every method on every task it applies to (embedded model, test
# split) into results/, each also with --prompt (the prompting baseline: the task's instruction
# before the prompt; `--method none --prompt` is the prompt alone), then prints the README's
# Results tables (the methods; none / prompt / method / prompt + method with bootstrap intervals).
# Usage: benchmarks/eval_results.sh [LIMIT] [GENERATE_LIMIT]
#   LIMIT: the first N test examples of every task (default all 80);
#   GENERATE_LIMIT: of the generation tasks json_format and pronoun_change (default LIMIT).
set -euo pipefail
cd "$(dirname "$0")/.."
HS=.venv/bin/headsteer
LIMIT=${1:-}
GEN_LIMIT=${2:-$LIMIT}
mkdir -p results
run() {  # task method [--prompt]
  local tag="" lim=$LIMIT
  [ "${3:-}" = "--prompt" ] && tag=".prompt"
  case "$1" in json_format|pronoun_change) lim=$GEN_LIMIT ;; esac
  local out="results/$1.$2$tag.test.csv"
  [ -s "$out" ] && return 0
  $HS --quiet eval --task "$1" --method "$2" ${3:-} --split test ${lim:+--limit "$lim"} --out "$out" --force >/dev/null
  echo "done $1 / $2 ${3:-}" >&2
}
both() { run "$1" "$2"; run "$1" "$2" --prompt; }
for task in json_format pronoun_change occupation counterfact; do
  for method in none pasta spotlight instaboost act; do both "$task" "$method"; done
done
for method in none act caa; do both sentiment "$method"; done
for method in none pasta spotlight instaboost act caa var vhr; do both context_qa "$method"; done
for task in counterfact occupation; do both "$task" caa; done
for task in counterfact occupation; do
  for method in var vhr; do both "$task" "$method"; done
done
.venv/bin/python benchmarks/results_table.py results
