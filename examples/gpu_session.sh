#!/usr/bin/env bash
# One call on a lent GPU: install, build the kernels, run the CUDA tests, sanitizers and benchmarks.
#   bash examples/gpu_session.sh [smoke|test|sanitize|bench-mlp|bench-host|bench-model|profile|sweep|script NAME.py|all] [args...]
# Extra arguments go to pytest (test, e.g. -n 4 with pytest-xdist), to sanitize_case.py (sanitize) or to the script run.
# Wheels for packages the GPU image lacks (expecttest; pytest-xdist and execnet for -n) may be carried in .whl/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/twell_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index . 2>&1 | grep -v WARNING | tail -3
cd /tmp  # import the installed package, not the checkout
REPO=$OLDPWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 -c "
import time, torch; t=time.time()
from twell_compile.kernels.build import cuda_extension; cuda_extension(); print(f'extension ready in {time.time()-t:.1f}s')"
what=${1:-all}
run_tests() { python3 -m pytest -q -x -m cuda "$@" -p no:cacheprovider "$REPO/tests" 2>&1 | tee -a "$OUT/tests.log" | tail -40; }
case $what in
  smoke) run_tests -k "uniform_sparsity and 2048x5632 and bfloat16 and (m-1- or m-4097) or adversarial or graph" ;;
  test) run_tests "${@:2}" ;;
  sanitize)
    for tool in memcheck racecheck; do
      compute-sanitizer --tool $tool --target-processes all python3 "$REPO/examples/sanitize_case.py" "${@:2}" 2>&1 |
        tee "$OUT/sanitize_$tool.log" | tail -6
    done ;;
  bench-mlp) python3 "$REPO/examples/bench_mlp.py" --json "$OUT/bench_mlp.json" "${@:2}" 2>&1 | tee "$OUT/bench_mlp.log" ;;
  bench-host) python3 "$REPO/examples/bench_host_time.py" "${@:2}" 2>&1 | tee "$OUT/bench_host.log" ;;
  profile) python3 "$REPO/examples/profile_twell.py" "${@:2}" 2>&1 | tee -a "$OUT/profile.log" ;;
  sweep) python3 "$REPO/examples/sweep_sparse_launch.py" "${@:2}" 2>&1 | tee -a "$OUT/sweep.log" ;;
  bench-model) python3 "$REPO/examples/bench_model.py" "${@:2}" 2>&1 | tee "$OUT/bench_model.log" ;;
  script) python3 "$REPO/examples/$2" "${@:3}" 2>&1 | tee -a "$OUT/script.log" ;;
  all) run_tests; python3 "$REPO/examples/bench_mlp.py" --json "$OUT/bench_mlp.json" 2>&1 | tee "$OUT/bench_mlp.log" ;;
esac
