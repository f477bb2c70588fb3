"""The README's table of predicted steps, generated (never typed in):

    python -m profiling.model_table                 # compiled model (the SASS), markdown
    python -m profiling.model_table --beside-source # the source model's figure beside each
    python -m profiling.model_table --write profiling/README.md   # regenerate the README's table

``--write FILE`` replaces the table between FILE's ``<!-- model_table: begin ...-->`` and
``<!-- model_table: end -->`` lines (tests/test_readme.py checks it is current).

Rows: the hidden-4096 and hidden-5120 presets, without and with the 152K LM head; columns:
2K, 8K, 32K windows. Each cell: ratio to the HBM floor (step µs), H200 parameters, static
counters (plus the emulator's trip counts the compiled model needs). Predictions, not
measurements.
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


BLOCK = re.compile(r"(<!-- model_table: begin[^\n]*-->\n)(.*?)(\n<!-- model_table: end -->)", re.S)


def readme_table(text: str) -> str:
    """The table between the markers of ``text``; ``ValueError`` if there are not exactly one pair."""
    found = BLOCK.findall(text)
    if len(found) != 1:
        raise ValueError(f"expected one '<!-- model_table: begin/end -->' block, found {len(found)}")
    return found[0][1]


def with_table(text: str, table_md: str) -> str:
    """``text`` with the table between its markers replaced by ``table_md``."""
    readme_table(text)
    return BLOCK.sub(lambda m: m.group(1) + table_md.strip("\n") + m.group(3), text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m profiling.model_table", description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", default="H200")
    p.add_argument("--beside-source", action="store_true", help="the source model's figures beside")
    p.add_argument("--write", metavar="FILE", help="replace the table between FILE's model_table markers")
    a = p.parse_args(argv)
    t = table(a.gpu, a.beside_source)
    if a.write:
        path = Path(a.write)
        path.write_text(with_table(path.read_text(), t))
    print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
