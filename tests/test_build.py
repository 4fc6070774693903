"""The CUDA build's inputs (CPU-only checks): every file in csrc/ is compiled or hashed, so an edit to
any of them rebuilds the cached extension, and every local include resolves to a listed header."""

from __future__ import annotations

import re

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
