#!/usr/bin/env bash
# One device call: build this tree and ab_other/ side by side, then record one chunked-kernel launch of
# each under Nsight Compute (base clocks): speed of light, the pipes' utilization, warp states and
# per-instruction stalls (summarized by examples/ncu_pc_stalls.py).   bash examples/ncu_ab_chunked.sh "PROFILE ARGS"
source "$(dirname "$0")/ab_setup.sh"
for variant in this other; do
  PYTHONPATH=$(variant_path $variant) ncu --clock-control base --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section SourceCounters --section InstructionStats -k regex:chunked_mlp --launch-count 1 \
    -o /tmp/$variant python3 "$REPO/examples/profile_twell.py" $1 --chunked-rows 1 --plain 2 > /dev/null 2>&1
  echo "=== $variant" | tee -a "$OUT/ncu.log"
  ncu -i /tmp/$variant.ncu-rep --page details 2>&1 | grep -E "Duration|Elapsed Cycles|Issue Slots Busy|Executed Ipc A|Compute \(SM\) Throughput|Memory Throughput|Pipe|Executed Instructions  " | tee -a "$OUT/ncu.log"
  ncu -i /tmp/$variant.ncu-rep --page raw 2>&1 | grep -E "sm__inst_executed_pipe_[a-z_]*\.avg\.pct_of_peak_sustained_active|sm__pipe_[a-z_]*cycles_active\.avg\.pct_of_peak_sustained_active" | sort -k3 -n -r | head -14 | tee -a "$OUT/ncu.log"
  python3 "$REPO/examples/ncu_pc_stalls.py" /tmp/$variant.ncu-rep --top 12 2>&1 | tee -a "$OUT/ncu.log" | tail -30
done
