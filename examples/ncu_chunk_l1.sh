#!/usr/bin/env bash
# One chunked-kernel launch per case under Nsight Compute (base clocks): the L1/shared-memory pipe's
# wavefronts by kind, the global requests, issue activity.   bash examples/ncu_chunk_l1.sh "LESION:NNZ ..." [M]
# METRICS replaces the L1 metrics (a --metrics list). LESION is TWELL_CHUNKED_LESION, read by the lesion
# builds of branch chunk-lesions; main ignores it (use 0). Needs the package installed (gpu_session.sh does
# that) and ncu; run it from outside the checkout so that the installed package is imported.
REPO=${REPO:-$(cd "$(dirname "$0")/.." && pwd)}
M=${2:-65536}
metrics=${METRICS:-"regex:^l1tex__(data_pipe_lsu_wavefronts|data_bank_conflicts_pipe_lsu|t_requests_pipe_lsu_mem_global|t_sectors_pipe_lsu_mem_global|m_xbar2l1tex_read_bytes|throughput).*(sum|pct_of_peak_sustained_elapsed)$"}
metrics="$metrics,sm__cycles_elapsed.avg,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active"
for case in $1; do
  lesion=${case%%:*}; nnz=${case##*:}
  TWELL_CHUNKED_LESION=$lesion ncu --clock-control base --metrics "$metrics" -k regex:chunked_mlp --launch-count 1 \
    -o /tmp/l1_${lesion}_${nnz} -f python3 "$REPO/examples/profile_twell.py" --m "$M" --nnz "$nnz" --chunked-rows 1 --plain 2 > /tmp/ncu_${lesion}_${nnz}.txt 2>&1
  echo "=== lesion $lesion, nnz $nnz, M $M"
  ncu -i /tmp/l1_${lesion}_${nnz}.ncu-rep --page raw --csv 2>/dev/null | python3 -c "
import csv, sys
rows = list(csv.reader(sys.stdin))
names, units, values = rows[0], rows[1], rows[2]
for n, u, v in zip(names, units, values):
    if n.startswith(('l1tex__', 'sm__cycles', 'smsp__', 'dram__', 'lts__', 'gpu__')) and v not in ('', 'n/a', '0'):
        print(f'  {n:75s} {v:>18s} {u}')
" || tail -5 /tmp/ncu_${lesion}_${nnz}.txt
done
