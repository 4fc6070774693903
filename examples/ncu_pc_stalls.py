"""Where a kernel's warps wait, instruction by instruction, from an Nsight Compute report.

Record one launch with warp-state sampling, then summarize it here (on the machine with ncu):

    ncu --clock-control base --section WarpStateStats --section SourceCounters -k regex:chunked_mlp \
        --launch-count 1 -o /tmp/chunk python3 examples/profile_twell.py --plain 2
    python3 examples/ncu_pc_stalls.py /tmp/chunk.ncu-rep --top 40

Prints each instruction's share of all samples with its two main stall reasons, then the totals per
reason. Uses the `ncu_report` module that ships with Nsight Compute (extras/python).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import sys

SAMPLE_PREFIX = "smsp__pcsamp_warps_issue_stalled_"


def import_ncu_report():
    candidates = sorted(glob.glob("/opt/nvidia/nsight-compute/*/extras/python"))
    candidates += sorted(glob.glob("/usr/local/cuda*/nsight-compute*/extras/python"))
    ncu = os.popen("command -v ncu").read().strip()
    if ncu:
        candidates.append(os.path.join(os.path.dirname(os.path.realpath(ncu)), "extras", "python"))
    for path in candidates:
        if os.path.isfile(os.path.join(path, "ncu_report.py")):
            sys.path.insert(0, path)
            break
    import ncu_report  # noqa: PLC0415 (found at run time)

    return ncu_report


def per_pc(metric) -> dict[int, int]:
    """The metric's instance values keyed by the instructions' addresses."""
    ids = metric.correlation_ids()
    return {int(ids.as_uint64(i)): int(metric.as_uint64(i)) for i in range(metric.num_instances())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("report")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    ncu_report = import_ncu_report()
    action = ncu_report.load_report(args.report).range_by_idx(0).action_by_idx(0)
    print(f"# {action.name()}")
    reasons: dict[str, dict[int, int]] = {}
    for name in action.metric_names():
        if name.startswith(SAMPLE_PREFIX) and not name.endswith("_not_issued"):
            metric = action.metric_by_name(name)
            if metric.num_instances() > 0:
                reasons[name[len(SAMPLE_PREFIX):]] = per_pc(metric)
    if not reasons:
        sys.exit("no per-instruction stall samples in this report (record it with --section SourceCounters)")
    samples: collections.Counter[int] = collections.Counter()
    for by_pc in reasons.values():
        samples.update(by_pc)
    total = sum(samples.values())
    print(f"# total samples {total}")
    print("# share   address  samples  SASS  (top 2 stall reasons)")
    for pc, n in samples.most_common(args.top):
        top = sorted(((by_pc.get(pc, 0), r) for r, by_pc in reasons.items()), reverse=True)[:2]
        sass = action.sass_by_pc(pc) if hasattr(action, "sass_by_pc") else ""
        print(f"{100 * n / total:5.1f}% {pc:8x} {n:8d}  {sass:<60s} " + ", ".join(f"{r} {c}" for c, r in top if c))
    print("# per reason, all instructions")
    for reason, by_pc in sorted(reasons.items(), key=lambda kv: -sum(kv[1].values())):
        share = sum(by_pc.values()) / total
        if share >= 0.005:
            print(f"  {reason:28s} {100 * share:5.1f}%")


if __name__ == "__main__":
    main()
