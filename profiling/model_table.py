"""The README's table of predicted steps, generated (never typed in):

    python -m profiling.model_table                 # compiled model (the SASS), markdown
    python -m profiling.model_table --beside-source # the source model's figure beside each
    python -m profiling.model_table --write profiling/README.md   # regenerate the README's table

``--write FILE`` replaces the table between FILE's ``<!-- model_table: begin ...-->`` and
``<!-- model_table: end -->`` lines (tests/test_readme.py checks it is current).

Rows: the hidden-4096 and hidden-5120 presets, without and with the 152K LM head; columns:
2K, 8K, 32K windows. Each cell: ratio to the HBM floor (step µs), H200 parameters, static
counters (plus the emulator's trip counts the compiled model needs). A second table: the
DFlash 2 presets at 2K beside the same drafters without their convolutions and selector.
Predictions, not measurements.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from .hw_params import get_gpu
from .perf_model import model_step

ROWS = (("h4096", None, "hidden 4096 (qwen3-8b)"), ("h5120", None, "hidden 5120 (qwen3.5-27b)"),
        ("h4096", 151936, "hidden 4096, lm_head 151936"), ("h5120", 151936, "hidden 5120, lm_head 151936"))
WINDOWS = (2048, 8192, 32768)
# DFlash 2 presets at a 2K window, beside the same drafter without its convolutions and selector
DFLASH2_ROWS = (("dflash2-h5120", 151936, "DFlash 2 hidden 5120, lm_head 151936"),
                ("dflash2-h6656", 202048, "DFlash 2 hidden 6656 (z-lab), lm_head 202048"))


def cell(m: dict) -> str:
    return f"{m['ratio']:.2f}x ({m['step_us']:.0f} µs)"


def table(gpu_name: str = "H200", beside_source: bool = False, windows=WINDOWS, rows=ROWS) -> str:
    gpu = get_gpu(gpu_name)
    head = "| drafter | " + " | ".join(f"{w // 1024}K" for w in windows) + " |"
    out = [head, "|---" * (len(windows) + 1) + "|"]
    for drafter, vocab, name in rows:
        cells = []
        for w in windows:
            m = model_step(drafter, w, gpu, lm_head_vocab=vocab)
            c = cell(m)
            if beside_source:
                c += f", source model {cell(model_step(drafter, w, gpu, lm_head_vocab=vocab, compiled=False))}"
            cells.append(c)
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def dflash2_table(gpu_name: str = "H200", window: int = 2048, rows=DFLASH2_ROWS) -> str:
    """The DFlash 2 presets: the step with the convolutions and the selector, the same drafter
    without them (the LM head's argmax), and what they add (the issue's goal: <= 5%)."""
    gpu = get_gpu(gpu_name)
    out = [f"| DFlash 2 drafter | {window // 1024}K | without conv / selector | added |", "|---|---|---|---|"]
    for drafter, vocab, name in rows:
        a = model_step(drafter, window, gpu, lm_head_vocab=vocab)
        b = model_step(drafter, window, gpu, lm_head_vocab=vocab, plain=True)
        out.append(f"| {name} | {cell(a)} | {cell(b)} | {100 * (a['step_us'] / b['step_us'] - 1):+.1f}% |")
    return "\n".join(out)


def _block(name: str):
    return re.compile(rf"(<!-- {name}: begin[^\n]*-->\n)(.*?)(\n<!-- {name}: end -->)", re.S)


def readme_table(text: str, name: str = "model_table") -> str:
    """The table between the ``name`` markers of ``text``; ``ValueError`` if there are not exactly
    one pair."""
    found = _block(name).findall(text)
    if len(found) != 1:
        raise ValueError(f"expected one '<!-- {name}: begin/end -->' block, found {len(found)}")
    return found[0][1]


def with_table(text: str, table_md: str, name: str = "model_table") -> str:
    """``text`` with the table between its ``name`` markers replaced by ``table_md``."""
    readme_table(text, name)
    return _block(name).sub(lambda m: m.group(1) + table_md.strip("\n") + m.group(3), text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m profiling.model_table", description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", default="H200")
    p.add_argument("--beside-source", action="store_true", help="the source model's figures beside")
    p.add_argument("--write", metavar="FILE", help="replace the table between FILE's model_table markers")
    a = p.parse_args(argv)
    t = table(a.gpu, a.beside_source)
    t2 = dflash2_table(a.gpu)
    if a.write:
        path = Path(a.write)
        path.write_text(with_table(with_table(path.read_text(), t), t2, "model_table_dflash2"))
    print(t + "\n\n" + t2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
