#!/usr/bin/env bash
# One device call: build this tree and ab_other/ (another variant of the kernels) side by side, time the
# chunked kernel of both alternately (torch.profiler, examples/profile_twell.py), then run the CUDA
# suite on this tree.   bash examples/ab_then_test.sh "CASES" ROUNDS [pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/twell_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation --no-index . 2>&1 | grep -v WARNING | tail -3
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/othersite ./ab_other 2>&1 | grep -v WARNING | tail -3
REPO=$PWD; cd /tmp
nvidia-smi --query-gpu=name --format=csv,noheader
build='import time; t=time.time(); from twell_compile.kernels.build import cuda_extension; cuda_extension(); print(f"built in {time.time()-t:.0f}s")'
PYTHONPATH=/tmp/site python3 -c "$build" & PYTHONPATH=/tmp/othersite:/tmp/site python3 -c "$build" & wait
IFS=';' read -ra cases <<< "$1"
for r in $(seq "$2"); do
  for variant in this other; do
    path=/tmp/site; [ $variant = other ] && path=/tmp/othersite:/tmp/site
    for c in "${cases[@]}"; do
      us=$(PYTHONPATH=$path python3 "$REPO/examples/profile_twell.py" $c --chunked-rows 1 | grep -m1 -E "^  chunked_mlp_kernel" | awk '{print $(NF-1)}')
      echo "variant=$variant $c chunked_us=$us" | tee -a "$OUT/ab.log"
    done
  done
done
[ "${3:-}" = "none" ] && exit 0
PYTHONPATH=/tmp/site python3 -m pytest -q -x -m cuda "${@:3}" -p no:cacheprovider "$REPO/tests" 2>&1 | tee "$OUT/tests.log" | tail -15
