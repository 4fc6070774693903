#!/usr/bin/env bash
# One device call: build this tree and ab_other/ (another variant of the kernels) side by side, time the
# chunked kernel of both alternately (torch.profiler, examples/profile_twell.py), then run the CUDA
# suite on this tree.   bash examples/ab_then_test.sh "CASES" ROUNDS [pytest args | none]
source "$(dirname "$0")/ab_setup.sh"
IFS=';' read -ra cases <<< "$1"
for r in $(seq "$2"); do
  for variant in this other; do
    for c in "${cases[@]}"; do
      us=$(PYTHONPATH=$(variant_path $variant) python3 "$REPO/examples/profile_twell.py" $c --chunked-rows 1 |
           grep -m1 -E "^  chunked_mlp_kernel" | awk '{print $(NF-1)}')
      echo "variant=$variant $c chunked_us=$us" | tee -a "$OUT/ab.log"
    done
  done
done
[ "${3:-}" = "none" ] && exit 0
PYTHONPATH=$(variant_path this) python3 -m pytest -q -x -m cuda "${@:3}" -p no:cacheprovider "$REPO/tests" 2>&1 |
  tee "$OUT/tests.log" | tail -15
