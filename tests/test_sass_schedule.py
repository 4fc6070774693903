"""The decode GEMV's weight loads stay issued together in the compiled code (no GPU needed).

ptxas may schedule a load late, next to its first use. For ``decode_gemv_kernel`` it interleaved each K
step's loads with the previous step's MMAs, about 5 of a step's 24 loads in flight per lane, until its
launch bound asked for 3 CTAs per SM (csrc/twell_decode_gemv.cu; with cold weights that made the 2B
gate GEMV 1.0-1.2 us faster on an H200). This compiles the file for sm_90a, device code only, and counts
the 16-byte global loads issued before the first MMA in the SASS of the gate kernels for 1-16 and 17-32
rows, and how their CTAs exchange partials: pushed with no barrier at the exit (1-16 rows), or pulled
with a relaxed last barrier (17-32). It needs nvcc and cuobjdump (Triton's wheel ships one) and skips
without them; about a minute of compiling.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
    except ImportError:
        return None
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if bundled.exists() else None


def _include_dirs(tmp_path: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths

    dirs = list(include_paths()) + [sysconfig.get_paths()["include"], str(REPO / "csrc")]
    # A CPU build of torch lacks the header CMake writes for CUDA builds; the device code needs none of it.
    if not any((Path(d) / "c10/cuda/impl/cuda_cmake_macros.h").exists() for d in dirs):
        stub = tmp_path / "stub" / "c10" / "cuda" / "impl"
        stub.mkdir(parents=True)
        (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
        dirs.insert(0, str(tmp_path / "stub"))
    return dirs


def _kernel_sass(sass: str, name_pattern: str) -> list[str]:
    """The instructions of the one function whose mangled name matches ``name_pattern``."""
    functions = re.split(r"\n\s*Function : ", sass)
    matches = [f for f in functions[1:] if re.match(name_pattern, f.split("\n", 1)[0])]
    assert len(matches) == 1, f"{len(matches)} functions match {name_pattern!r}"
    return [line for line in matches[0].split("\n") if re.search(r"/\*[0-9a-f]{4}\*/", line)]


@pytest.mark.skipif(shutil.which("nvcc") is None or _cuobjdump() is None, reason="needs nvcc and cuobjdump")
def test_decode_gate_gemv_issues_a_steps_loads_before_its_mmas(tmp_path):
    cubin = tmp_path / "decode_gemv.cubin"
    includes = [f"-I{d}" for d in _include_dirs(tmp_path)]
    build = subprocess.run(
        ["nvcc", "-O3", "-std=c++17", "-cubin", "-arch=sm_90a", *includes, str(REPO / "csrc/twell_decode_gemv.cu"),
         "-o", str(cubin)],
        capture_output=True, text=True,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    sass = subprocess.run([_cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    # decode_gemv_kernel<__nv_bfloat16, Epilogue::kTwellPack, MMA row tiles, K chunks a step>: the gate at
    # 1-16 rows (one tile, 4 chunks: 4 x (4 runs of W + 2 of x) = 24 loads a step) and 17-32 rows (two
    # tiles, 3 chunks: 3 x (4 + 4) = 24). Ask for most of them, not an exact schedule.
    for variant in ("Li1ELi4E", "Li2ELi3E"):
        body = _kernel_sass(sass, r".*decode_gemv_kernelI13__nv_bfloat16LNS0_8EpilogueE0E" + variant)
        first_mma = next(i for i, line in enumerate(body) if "HMMA" in line)
        loads = sum("LDG.E.128" in line for line in body[:first_mma])
        assert loads >= 16, f"{variant}: only {loads} 16-byte loads before the first MMA: ptxas serialized them"
        if variant == "Li1ELi4E":
            _assert_pushes_partials(variant, body)
        else:
            _assert_pulls_partials(variant, body)


def _assert_pushes_partials(variant: str, body: list[str]) -> None:
    # Up to 16 rows each CTA pushes its partials to the CTAs that reduce them (posted st.shared::cluster
    # of 16 bytes, ST.E.128: a lane swaps column pairs with its neighbour first, so no 8-byte pushes) and
    # reads nothing over distributed shared memory (LD.E): ptxas puts each remote load right before its
    # adds, a round trip each. After the last cluster barrier the reduction reads its own shared memory
    # (LDS.128), and no barrier waits at the exit.
    assert not any(re.search(r"\bLD\.E", line) for line in body), f"{variant}: a remote load"
    last_wait = max(i for i, line in enumerate(body) if "UCGABAR_WAIT" in line)
    pushes = sum("ST.E.128" in line for line in body[:last_wait])
    assert pushes == 4, f"{variant}: {pushes} 16-byte pushes before the last barrier, want one per n8 block"
    assert not any("ST.E.64" in line for line in body), f"{variant}: an 8-byte push"
    assert any("LDS.128" in line for line in body[last_wait:]), f"{variant}: no local reduction after it"
    first_store = min(i for i, line in enumerate(body) if "STG" in line)
    assert not any("UCGABAR" in line for line in body[first_store:]), f"{variant}: a cluster barrier after the row stores"


def _assert_pulls_partials(variant: str, body: list[str]) -> None:
    # Past 16 rows the reducing warps load the partials (LD.E.128), and the last cluster barrier only
    # keeps shared memory alive for those loads: its arrival is relaxed (ptx::cluster_sync_before_exit),
    # with no MEMBAR between the row stores and the exit.
    assert any("LD.E.128" in line for line in body), f"{variant}: no remote loads of the partials"
    last_arrive = max(i for i, line in enumerate(body) if "UCGABAR_ARV" in line)
    last_store = max(i for i, line in enumerate(body[:last_arrive]) if "STG" in line)
    assert not any("MEMBAR" in line for line in body[last_store:last_arrive]), \
        f"{variant}: a memory barrier before the last cluster arrival"
