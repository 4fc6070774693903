"""The CUDA build's inputs and where the kernels may run (CPU-only checks): every file in csrc/ is
compiled or hashed, so an edit to any of them rebuilds the cached extension, and every local include
resolves to a listed header; a GPU that is not Hopper, a failed build or the off switch give one clear
warning and the reference path."""

from __future__ import annotations

import re
import warnings

from pathlib import Path

import pytest
import torch

from twell_compile.kernels import build


def test_every_csrc_file_is_a_listed_source_or_header():
    present = {p.name for p in build.csrc_dir().iterdir() if p.suffix in (".cu", ".cuh", ".cpp", ".h")}
    assert present == set(build._SOURCES) | set(build._HEADERS)


def test_local_includes_are_listed_headers():
    for name in build._SOURCES + build._HEADERS:
        text = (build.csrc_dir() / name).read_text()
        for included in re.findall(r'#include "([^"]+)"', text):
            assert included in build._HEADERS, f"{name} includes {included}, which the build does not hash"


def test_cache_directory_changes_with_any_header(tmp_path, monkeypatch):
    monkeypatch.setenv("TWELL_CACHE_DIR", str(tmp_path))
    files = []
    for name in build._SOURCES + build._HEADERS:
        copy = tmp_path / name
        copy.write_text((build.csrc_dir() / name).read_text())
        files.append(copy)
    before = build._cache_dir(files)
    files[-1].write_text(files[-1].read_text() + "\n// edited\n")
    assert build._cache_dir(files) != before


# ---------------------------------------------------------------------------------------------------
# Where the kernels cannot run: one clear warning, then the reference (checked here with the CUDA
# queries replaced, so on any machine)
# ---------------------------------------------------------------------------------------------------


@pytest.fixture
def fresh_availability(monkeypatch):
    """kernels_available() with its per-process caches emptied before and after the test."""
    monkeypatch.delenv("TWELL_DISABLE_KERNELS", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA Test GPU")
    build._unavailable_reason.cache_clear()
    build._build_failure.cache_clear()
    build._warn_once.cache_clear()
    yield monkeypatch
    build._unavailable_reason.cache_clear()
    build._build_failure.cache_clear()
    build._warn_once.cache_clear()


def _available_with_warnings(device=torch.device("cuda", 0)) -> tuple[bool, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = build.kernels_available(device)
    return available, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize("capability, name", [((8, 0), "sm_80"), ((10, 0), "sm_100"), ((8, 9), "sm_89")])
def test_other_gpus_fall_back_with_one_warning(fresh_availability, capability, name):
    fresh_availability.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    fresh_availability.setattr(build, "cuda_extension", lambda: pytest.fail("must not build for this GPU"))
    available, messages = _available_with_warnings()
    assert not available
    assert messages == [f"twell: using the reference (dense PyTorch) implementation on CUDA because the kernels "
                        f"target Hopper (sm_90a) and NVIDIA Test GPU is {name}."]
    assert _available_with_warnings() == (False, [])  # once per process, not per call


def test_failed_build_falls_back_with_the_reason(fresh_availability):
    fresh_availability.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))

    def no_nvcc():
        raise FileNotFoundError("nvcc not found")

    fresh_availability.setattr(build, "cuda_extension", no_nvcc)
    available, messages = _available_with_warnings()
    assert not available
    assert len(messages) == 1
    assert "building the CUDA extension failed: FileNotFoundError: nvcc not found" in messages[0]


def test_a_failed_build_is_tried_once_for_all_gpus(fresh_availability):
    fresh_availability.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    attempts = []

    def failing_build():
        attempts.append(1)
        raise RuntimeError("nvcc failed")

    fresh_availability.setattr(build, "cuda_extension", failing_build)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert not any(build.kernels_available(torch.device("cuda", i)) for i in range(4))
    assert len(attempts) == 1


def test_kernels_can_be_switched_off(fresh_availability):
    fresh_availability.setenv("TWELL_DISABLE_KERNELS", "1")
    fresh_availability.setattr(torch.cuda, "get_device_capability", lambda index=None: pytest.fail("not asked"))
    available, messages = _available_with_warnings()
    assert not available and len(messages) == 1 and "TWELL_DISABLE_KERNELS is set" in messages[0]


def test_hopper_with_a_working_build_runs_the_kernels(fresh_availability):
    fresh_availability.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    fresh_availability.setattr(build, "cuda_extension", lambda: object())
    assert _available_with_warnings() == (True, [])


def test_cuda_path_without_kernels_is_the_reference(fresh_availability):
    # What a bf16 call on an sm_80 GPU runs: the reference, with the same numbers as eager.
    from twell_compile import kernels
    from twell_compile.testing import make_problem

    fresh_availability.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    p = make_problem(7, 16, 48, nnz_per_row=8, bias=True, device="cpu")
    # The op's device is CPU here, so hand kernels_available the CUDA device the real call would name.
    real = build.kernels_available
    fresh_availability.setattr(build, "kernels_available", lambda device: real(torch.device("cuda", 0)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = kernels.cuda_gated_relu_mlp(*p.gated_args())
    expected = kernels.reference_gated_relu_mlp(*p.gated_args())
    assert torch.equal(out, expected)


def test_first_build_says_it_is_compiling(tmp_path, monkeypatch, capsys):
    import torch.utils.cpp_extension

    loads = []
    monkeypatch.setenv("TWELL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kwargs: loads.append(kwargs) or "module")
    build_extension = build.cuda_extension.__wrapped__  # the uncached function
    assert build_extension() == "module"
    assert "twell: compiling the CUDA kernels" in capsys.readouterr().err
    build_dir = loads[0]["build_directory"]
    assert build_dir.startswith(str(tmp_path)) and loads[0]["extra_cuda_cflags"] == build._NVCC_FLAGS
    (tmp_path / build_dir / "twell_cuda.so").write_bytes(b"")  # what a finished build leaves
    build_extension()
    assert capsys.readouterr().err == ""  # built before: loaded from the cache, silently


def test_the_lock_file_of_a_killed_build_is_removed(tmp_path, monkeypatch):
    """torch's cpp_extension.load waits for as long as its ``lock`` file exists; a build killed midway
    leaves it behind. Under twell's own lock (released by the kernel when its holder dies) such a file
    can only be stale, and it is removed before building."""
    import torch.utils.cpp_extension

    monkeypatch.setenv("TWELL_CACHE_DIR", str(tmp_path))
    lock_seen = []

    def load(**kwargs):
        lock_seen.append((Path(kwargs["build_directory"]) / "lock").exists())
        return "module"

    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    build_extension = build.cuda_extension.__wrapped__
    build_extension()
    build_dir = next(p for p in tmp_path.rglob("*") if p.is_dir() and (p / ".twell_build.lock").exists())
    (build_dir / "lock").write_text("")  # what a killed build leaves
    assert build_extension() == "module"
    assert lock_seen == [False, False] and not (build_dir / "lock").exists()


def test_finished_build_is_imported_without_ninja(tmp_path, monkeypatch):
    # Reinstalling the package copies csrc anew; ninja would then rebuild everything from its timestamps.
    import torch.utils.cpp_extension

    monkeypatch.setenv("TWELL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kwargs: pytest.fail("ninja ran"))
    imported = []
    monkeypatch.setattr(build, "_import_built", lambda library: imported.append(library) or "cached module")
    assert build.cuda_extension.__wrapped__() == "cached module"
    assert imported[0].name == "twell_cuda.so" and imported[0].parent.parent == tmp_path


def test_import_of_a_built_library(tmp_path):
    library = tmp_path / "module.py"  # any file the import machinery loads stands in for the .so
    library.write_text("ANSWER = 42\n")
    assert build._import_built(library).ANSWER == 42
    assert build._import_built(tmp_path / "missing.so") is None
    broken = tmp_path / "twell_cuda.so"
    broken.write_bytes(b"\x7fELF cut off while linking")
    assert build._import_built(broken) is None  # built again instead
