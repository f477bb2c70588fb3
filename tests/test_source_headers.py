"""Kernel file headers state contract, layout and launch shape in at most
MAX_HEADER_LINES lines (issue 25, item 4); figures and histories live in
docs/decisions/. The header is a file's leading block of ``//`` lines, without
its ``// nvrtc-check:`` / ``// nvrtc-arch:`` directives (build options, not prose).

CHECKED is every kernel source: cuda_src/*.cu, *.cuh and the test-only kernels."""
from pathlib import Path

import pytest

from dflash_cupy import kernels

ROOT = Path(__file__).resolve().parent.parent
MAX_HEADER_LINES = 40
DIRECTIVES = ("// nvrtc-check:", "// nvrtc-arch:")
CHECKED = tuple(sorted(p.relative_to(ROOT).as_posix() for p in (
    *kernels.CUDA_SRC.glob("*.cu"), *kernels.CUDA_SRC.glob("*.cuh"), *(ROOT / "tests" / "cuda").glob("*.cu"))))


def header_lines(text: str) -> list[str]:
    """The leading ``//`` block of ``text``, directives left out."""
    out = []
    for line in text.splitlines():
        if not line.startswith("//"):
            break
        if not line.startswith(DIRECTIVES):
            out.append(line)
    return out


def test_header_lines_stop_at_code_and_skip_directives():
    text = "// a\n// nvrtc-check: -DX=1\n//\n// b\n#include <x>\n// not header\n"
    assert header_lines(text) == ["// a", "//", "// b"]
    assert header_lines("#pragma once\n// late\n") == []


@pytest.mark.parametrize("rel", CHECKED)
def test_kernel_header_is_short(rel):
    path = ROOT / rel
    assert path.is_file(), f"{rel} is listed in CHECKED but does not exist (renamed? update the list)"
    lines = header_lines(path.read_text())
    assert lines, f"{rel} has no header comment (contract, layout, launch shape)"
    assert len(lines) <= MAX_HEADER_LINES, (
        f"{rel}: header of {len(lines)} lines > {MAX_HEADER_LINES}; state contract, layout and launch "
        f"shape, move figures and histories to docs/decisions/ and the reasons beside the code they explain")


def test_checked_files_are_kernel_sources():
    """CHECKED names only kernel sources (so a typo cannot pass silently)."""
    known = {p.relative_to(ROOT).as_posix() for p in (*kernels.CUDA_SRC.glob("*.cu"),
                                                       *kernels.CUDA_SRC.glob("*.cuh"),
                                                       *(ROOT / "tests" / "cuda").glob("*.cu"))}
    assert set(CHECKED) <= known, sorted(set(CHECKED) - known)
