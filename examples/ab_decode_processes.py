"""Default-mode decode steps under two values of an environment variable, alternated over fresh
processes: for effects that show per process rather than per call (host speed, allocator or driver
state), which an A/B inside one process cannot separate.

Each process runs ``profile_decode_host.py`` (dense ``torch.compile`` then ``backend="twell"``, in
that order, per batch) with the variable set to one value; the values alternate, ``--rounds`` times
each. The table gives every process's wall ms per step for both backends and their ratio, so a value
that slows the whole process (dense included) shows apart from one that slows only twell.

    python examples/ab_decode_processes.py --env TWELL_ROUTE_BY_DENSITY --values 1 0 --rounds 3 -- --batch 8
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import statistics
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parent / "profile_decode_host.py"
STEP_LINE = re.compile(r"^=== batch (\d+) (inductor|twell): ([0-9.]+) ms/step")


def run_once(env_name: str, value: str, args: list[str]) -> dict[tuple[int, str], float]:
    """ms per step by (batch, backend) from one fresh process with ``env_name=value``."""
    env = dict(os.environ, **{env_name: value})
    result = subprocess.run([sys.executable, str(SCRIPT), "--top", "0", *args], env=env, capture_output=True,
                            text=True, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"{env_name}={value} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    steps = {}
    for line in result.stdout.splitlines():
        match = STEP_LINE.match(line)
        if match:
            steps[(int(match[1]), match[2])] = float(match[3])
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", required=True, help="the environment variable to vary")
    parser.add_argument("--values", nargs=2, required=True, metavar=("A", "B"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("script_args", nargs=argparse.REMAINDER,
                        help="after --: arguments for profile_decode_host.py")
    args = parser.parse_args()
    script_args = [a for a in args.script_args if a != "--"]

    rows = []
    for round_index in range(args.rounds):
        for value in args.values:
            for (batch, backend), ms in sorted(run_once(args.env, value, script_args).items()):
                rows.append((round_index, value, batch, backend, ms))
            print(f"round {round_index + 1}, {args.env}={value}: done", flush=True)

    print(f"\nwall ms per decode step, one process per line (dense first, then twell); {args.env}")
    print("| round | value | batch | dense ms | twell ms | dense / twell |")
    print("|---|---|---|---|---|---|")
    ratios: dict[tuple[str, int], list[float]] = {}
    steps = {(r, v, b, backend): ms for r, v, b, backend, ms in rows}
    for round_index, value, batch, backend, _ in rows:
        if backend != "inductor":
            continue
        dense, twell = steps[(round_index, value, batch, "inductor")], steps.get((round_index, value, batch, "twell"))
        if twell is None:
            continue
        ratios.setdefault((value, batch), []).append(dense / twell)
        print(f"| {round_index + 1} | {value} | {batch} | {dense:.3f} | {twell:.3f} | {dense / twell:.3f}x |")
    print("\nmedian dense / twell per value and batch: " + ", ".join(
        f"{args.env}={value} batch {batch}: {statistics.median(r):.3f}x" for (value, batch), r in sorted(ratios.items())))


if __name__ == "__main__":
    main()
