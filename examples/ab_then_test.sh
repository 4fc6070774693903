#!/usr/bin/env bash
# One device call: build this tree and ab_other/ (another variant of the kernels) side by side, time one
# kernel of both alternately (torch.profiler, examples/profile_twell.py), then run the CUDA suite on
# this tree.   [KERNEL=NAME] bash examples/ab_then_test.sh "CASES" ROUNDS [pytest args | none]
# KERNEL is the start of the timed kernel's name in profile_twell.py's per-kernel lines: the chunked
# kernel by default, "twell_gemm_kernel pack" for the gate GEMM.
source "$(dirname "$0")/ab_setup.sh"
KERNEL=${KERNEL:-chunked_mlp_kernel}
IFS=';' read -ra cases <<< "$1"
for r in $(seq "$2"); do
  for variant in this other; do
    for c in "${cases[@]}"; do
      us=$(PYTHONPATH=$(variant_path $variant) python3 "$REPO/examples/profile_twell.py" $c --chunked-rows 1 |
           grep -m1 -E "^  $KERNEL" | awk '{print $(NF-1)}')
      echo "variant=$variant $c kernel=\"$KERNEL\" us=$us" | tee -a "$OUT/ab.log"
    done
  done
done
[ "${3:-}" = "none" ] && exit 0
PYTHONPATH=$(variant_path this) python3 -m pytest -q -x -m cuda "${@:3}" -p no:cacheprovider "$REPO/tests" 2>&1 |
  tee "$OUT/tests.log" | tail -15
