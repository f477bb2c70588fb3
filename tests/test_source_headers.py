"""Kernel file headers state contract, layout and launch shape in at most
MAX_HEADER_LINES lines (issue 25, item 4); figures and histories live in
docs/decisions/. The header is a file's leading block of ``//`` lines, without
its ``// nvrtc-check:`` / ``// nvrtc-arch:`` directives (build options, not prose).

CHECKED lists the files whose headers have been brought under the limit; every
kernel source is to join it (the GEMM files after their rework)."""
from pathlib import Path

import pytest

from dflash_cupy import kernels

ROOT = Path(__file__).resolve().parent.parent
MAX_HEADER_LINES = 40
DIRECTIVES = ("// nvrtc-check:", "// nvrtc-arch:")
CHECKED = (
    "cuda_src/arrive.cuh", "cuda_src/attention.cu", "cuda_src/attention_common.cuh", "cuda_src/attention_mma.cu",
    "cuda_src/bits16.cuh", "cuda_src/float_order.cuh", "cuda_src/hold.cu", "cuda_src/ldmatrix.cuh",
    "cuda_src/norm.cu", "cuda_src/pdl.cuh", "cuda_src/plan_mask.cuh", "cuda_src/ring_slots.cu",
    "cuda_src/rope.cu", "cuda_src/rope_math.cuh", "cuda_src/sample.cu", "cuda_src/warp.cuh",
    "tests/cuda/planning_unfused.cu",
)


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
