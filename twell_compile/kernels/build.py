"""Builds the CUDA extension from ``csrc/`` with ninja on first use, and says when kernels can run.

The build is cached per source hash under ``$TWELL_CACHE_DIR`` (default ``~/.cache/twell_compile``), so
it happens once per machine and version. Anything that keeps the kernels from running (no CUDA GPU,
not a Hopper GPU, no nvcc, no Triton, a failed build) is reported once, as a warning, and the ops fall
back to the reference implementation instead of failing.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import sys
import warnings
from pathlib import Path

import torch

_SOURCES = ("twell_ext.cpp", "twell_mlp_forward.cpp", "twell_fast_call.cpp", "twell_sparse_mlp.cu",
            "twell_sparse_chunked.cu", "twell_gemm.cu", "twell_decode_gemv.cu", "twell_gate_rebuild.cu",
            "twell_heavy_rows.cu", "twell_cublas_mlp.cu")
_HEADERS = ("twell_entries.h", "hopper_ptx.cuh", "dense_block_test.cuh", "dtype16.cuh", "cluster_launch.cuh",
            "backup_tile.cuh")
_MODULE = "twell_cuda"
_NVCC_FLAGS = ["-O3", "-std=c++17", "-lineinfo", "-gencode=arch=compute_90a,code=sm_90a"]


def csrc_dir() -> Path:
    """``csrc`` ships inside the package (``twell_compile/csrc``); an editable checkout has it at the root."""
    here = Path(__file__).resolve()
    for candidate in (here.parents[1] / "csrc", here.parents[2] / "csrc"):
        if all((candidate / s).is_file() for s in _SOURCES + _HEADERS):
            return candidate
    raise FileNotFoundError(f"twell: CUDA sources {_SOURCES} not found next to {here.parents[1]}")


def _cache_dir(sources: list[Path]) -> Path:
    digest = hashlib.sha256()
    for src in sources:
        digest.update(src.read_bytes())
    digest.update(" ".join(_NVCC_FLAGS).encode())
    digest.update(torch.__version__.encode())
    root = Path(os.environ.get("TWELL_CACHE_DIR", Path.home() / ".cache" / "twell_compile"))
    return root / f"cuda_ext_{digest.hexdigest()[:16]}"


def _import_built(library: Path):
    """The module a finished build left in ``library``, or None.

    The build directory is named by a hash of every source, header and flag, so a library there is
    the build of these sources. Importing it directly skips ninja's timestamp check, which recompiles
    everything (minutes) whenever the sources were copied anew, as reinstalling the package does."""
    if not library.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(_MODULE, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError):  # e.g. a build cut off while linking: build again
        return None
    return module


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """Holds an exclusive lock on the build folder: one process builds, the others wait and then load
    what it built. The kernel releases the lock when its holder dies, however it dies; so, while it is
    held, torch's own lock file (``lock``, which ``cpp_extension.load`` waits on for as long as it
    exists) can only be left over from a build that was killed, and it is removed: such a file made
    every later process wait forever."""
    try:
        import fcntl
    except ImportError:  # (not POSIX: torch's lock file alone)
        yield
        return
    with open(build_dir / ".twell_build.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@functools.cache
def cuda_extension():
    """The compiled extension module (raises if it cannot be built)."""
    from torch.utils.cpp_extension import load

    sources = [csrc_dir() / s for s in _SOURCES]
    build_dir = _cache_dir(sources + [csrc_dir() / h for h in _HEADERS])
    build_dir.mkdir(parents=True, exist_ok=True)
    module_path = build_dir / f"{_MODULE}.so"
    built = _import_built(module_path)
    if built is not None:
        return built
    with _build_lock(build_dir):
        built = _import_built(module_path)  # built by another process while this one waited
        if built is not None:
            return built
        if not any(build_dir.glob("*.so")):
            print(f"twell: compiling the CUDA kernels into {build_dir} (first use only; this takes a minute or "
                  f"two)...", file=sys.stderr, flush=True)
        return load(
            name=_MODULE,
            sources=[str(s) for s in sources],
            extra_cflags=["-O3", "-std=c++17"],
            extra_cuda_cflags=_NVCC_FLAGS,
            extra_include_paths=[str(csrc_dir())],
            build_directory=str(build_dir),
            verbose=False,
        )


@functools.cache
def _build_failure() -> str | None:
    """Why the extension cannot be built, or None; tried once per process (not once per GPU)."""
    try:
        cuda_extension()
    except Exception as exc:  # a missing nvcc or a compile error: report it, run the reference
        return f"building the CUDA extension failed: {type(exc).__name__}: {exc}"
    return None


@functools.cache
def _unavailable_reason(device_index: int) -> str | None:
    """None when the TwELL kernels can run on this CUDA device, else why not."""
    if os.environ.get("TWELL_DISABLE_KERNELS", "") not in ("", "0"):
        return "TWELL_DISABLE_KERNELS is set"
    major, minor = torch.cuda.get_device_capability(device_index)
    if (major, minor) != (9, 0):
        name = torch.cuda.get_device_name(device_index)
        return f"the kernels target Hopper (sm_90a) and {name} is sm_{major}{minor}"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    return _build_failure()


@functools.cache
def _warn_once(reason: str) -> None:
    warnings.warn(f"twell: using the reference (dense PyTorch) implementation on CUDA because {reason}.",
                  RuntimeWarning, stacklevel=3)


def kernels_available(device: torch.device) -> bool:
    """Whether the TwELL kernels run on ``device``; warns once with the reason when they do not."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    reason = _unavailable_reason(index)
    if reason is not None:
        _warn_once(reason)
        return False
    return True
