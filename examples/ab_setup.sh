# Sourced by ab_then_test.sh and ncu_ab_chunked.sh on a lent GPU: installs this tree (into the system
# site-packages) and the variant in ab_other/ (into /tmp/othersite), builds both extensions side by side,
# and leaves the shell in /tmp with REPO set and `variant_path this|other` giving each one's PYTHONPATH.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/twell_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation --no-index . 2>&1 | grep -v WARNING | tail -3
rm -rf /tmp/othersite  # pip --target leaves an existing install in place: a warm machine would keep the last variant
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/othersite ./ab_other 2>&1 | grep -v WARNING | tail -3
REPO=$PWD; cd /tmp
nvidia-smi --query-gpu=name --format=csv,noheader
variant_path() { if [ "$1" = other ]; then echo /tmp/othersite:/tmp/site; else echo /tmp/site; fi; }
build='import time; t=time.time(); from twell_compile.kernels.build import cuda_extension; cuda_extension(); print(f"built in {time.time()-t:.0f}s")'
PYTHONPATH=$(variant_path this) python3 -c "$build" & PYTHONPATH=$(variant_path other) python3 -c "$build" & wait
