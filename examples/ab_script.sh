#!/usr/bin/env bash
# One device call: build this tree and ab_other/ side by side (ab_setup.sh), then run one example script
# under each of them in turn, ROUNDS times, its output in $OUT/ab_script.log, each run headed by its variant.
#   bash examples/ab_script.sh ROUNDS SCRIPT.py [script args...]
source "$(dirname "$0")/ab_setup.sh"
for r in $(seq "$1"); do
  for variant in this other; do
    echo "=== variant=$variant round=$r" | tee -a "$OUT/ab_script.log"
    PYTHONPATH=$(variant_path $variant) python3 "$REPO/examples/$2" "${@:3}" 2>&1 | tee -a "$OUT/ab_script.log" | tail -12
  done
done
