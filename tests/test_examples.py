"""The scripts in examples/ run and report what they should (small settings, fresh interpreters)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def test_compile_hf_llama():
    out = run_example("compile_hf_llama.py", "--device", "cpu", "--layers", "2")
    assert "rewritten MLP blocks: 2 (model has 2 layers)" in out
    assert "model.layers.1.mlp [gated] REWRITTEN" in out
    assert out.rstrip().endswith("OK")


def test_rewrite_fx_graph():
    out = run_example("rewrite_fx_graph.py")
    assert "2 rewritten (1 gated, 1 non-gated), 0 left alone" in out
    assert "rewritten output equals the original on CPU: True" in out
    assert "gated_relu_mlp (torch.ops.twell.gated_relu_mlp.default) reads" in out
    assert "relu_mlp (torch.ops.twell.relu_mlp.default) reads" in out


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_bench_rewrite_cost(device):
    out = run_example(
        "bench_rewrite_cost.py", "--device", device, "--layers", "3", "--hidden", "32", "--intermediate", "64",
        "--heads", "4", "--runs", "2",
    )
    assert "rewritten blocks: 3, left alone: 0" in out
    assert "run_passes: median" in out


def test_bench_host_time_on_cpu():
    out = run_example("bench_host_time.py", "--cpu", "--calls", "50", "--rounds", "1")
    for op in ("gated_relu_mlp", "relu_mlp"):
        for mode in ("grad", "no_grad", "inference_mode"):
            assert any(line.startswith(op) and f" {mode} " in line and "dispatch + checks" in line
                       for line in out.splitlines()), (op, mode, out)


def test_bench_decode_on_cpu():
    out = run_example("bench_decode.py", "--device", "cpu", "--layers", "1", "--hidden", "64", "--intermediate",
                      "256", "--heads", "4", "--vocab", "128", "--batch", "2", "--prompt", "8", "--steps", "2",
                      "--warmup", "1", "--rounds", "1", "--mode", "default")
    row = out.rstrip().splitlines()[-1].split("|")
    assert row[1].strip() == "2" and row[6].strip() == "1/1", out  # batch 2; the one MLP rewritten
    assert float(row[5]) < 1e-2, out  # the reference ops on CPU: the dense model's answer
    mean, most = (float(v) for v in row[7].split("/"))
    assert 0 < mean <= most <= 256, out  # the decode steps' measured sparsity, of 256 units


def test_profile_decode_host_on_cpu():
    out = run_example("profile_decode_host.py", "--device", "cpu", "--layers", "1", "--hidden", "64",
                      "--intermediate", "256", "--heads", "4", "--vocab", "128", "--batch", "2", "--prompt", "8",
                      "--steps", "2", "--warmup", "1", "--top", "5")
    assert "=== batch 2 inductor:" in out and "=== batch 2 twell:" in out, out
    assert "recompiles {}" in out and "router: " in out, out
    assert "Ordered by: internal time" in out, out


def test_ab_decode_processes_on_cpu():
    out = run_example("ab_decode_processes.py", "--env", "TWELL_ROUTE_BY_DENSITY", "--values", "1", "0", "--rounds", "1",
                      "--", "--device", "cpu", "--layers", "1", "--hidden", "64", "--intermediate", "256", "--heads", "4",
                      "--vocab", "128", "--batch", "2", "--prompt", "8", "--steps", "2", "--warmup", "1")
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| 1 |")]
    assert [(r[1].strip(), r[2].strip()) for r in rows] == [("1", "2"), ("0", "2")], out  # one process per value
    assert all(float(r[3]) > 0 and float(r[4]) > 0 for r in rows), out
    assert "median dense / twell per value and batch" in out, out


def test_ab_decode_leases_on_cpu():
    out = run_example("ab_decode_leases.py", "--device", "cpu", "--layers", "1", "--hidden", "64", "--intermediate", "256",
                      "--heads", "4", "--vocab", "128", "--batch", "2", "--prompt", "8", "--steps", "2", "--warmup", "1",
                      "--rounds", "2")
    rows = {line[7:25].strip(): line for line in out.splitlines() if line.startswith("    2  ")}
    assert set(rows) == {"dense", "twell, leases", "twell, no leases"}, out
    assert "1.000x" in rows["dense"], out
    assert out.count("batch 2 twell, leases:") == 2 and out.count("batch 2 twell, no leases:") == 2, out
    assert "batch 2: dynamo frames {'total': 2, 'ok': 2} recompiles {}" in out, out  # both compiled, side by side
    mean, most = (float(v) for v in rows["dense"].rsplit(";", 1)[1].split("/"))
    assert 0 < mean <= most <= 256, out  # the decode steps' measured sparsity, of 256 units


def test_sparse_reuse():
    out = run_example("sparse_reuse.py", "--m", "512", "--hidden", "64", "--intermediate", "512", "--nnz", "8",
                      "--blocks", "1", "128", "512")
    rows = {int(line.split()[0]): line.split() for line in out.splitlines() if line.strip()[:1].isdigit()}
    assert set(rows) == {1, 128, 512}, out
    # One token per block reads its own rows: no reuse, the per-token design's traffic.
    assert rows[1][3] == "1.00" and rows[1][5] == "1.00", out
    # A larger block shares more rows, so it reads fewer bytes per token.
    assert float(rows[512][3]) > float(rows[128][3]) > 1.0 and float(rows[512][5]) < float(rows[128][5]) < 1.0, out


def test_mma_gather_model():
    out = run_example("mma_gather_model.py")
    assert "up projection, m16n8k8, 4 rotated variants: True" in out
    assert "down projection, m16n8k16, block-diagonal h: True" in out


def test_save_outputs_compare(tmp_path):
    """The A/B output check flags a single flipped bit (the saving half needs a GPU)."""
    import torch

    a = {"case": torch.randn(4, 8).to(torch.bfloat16)}
    b = {"case": a["case"].clone()}
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    assert "bitwise equal" in run_example("save_outputs.py", "compare", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"))
    b["case"].view(torch.int16)[1, 2] ^= 1
    torch.save(b, tmp_path / "b.pt")
    result = subprocess.run([sys.executable, str(EXAMPLES / "save_outputs.py"), "compare", str(tmp_path / "a.pt"),
                             str(tmp_path / "b.pt")], capture_output=True, text=True, timeout=600)
    assert result.returncode == 1 and "DIFFERENT" in result.stdout, result.stdout + result.stderr


def test_fuzz_kernels_on_the_reference_path():
    out = run_example("fuzz_kernels.py", "--device", "cpu", "--cases", "25", "--max-rows", "200", "--seed", "7")
    assert "25 cases in" in out and "25 passed" in out and "0 failed" in out, out[-2000:]
    assert "reference                    reference" in out  # the coverage table
