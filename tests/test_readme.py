"""The READMEs: the "Using it" example runs as written (on the default backend); their tables
are the layout, reference lists or generated (figures live in docs/decisions/)."""
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def test_using_it_example_runs(capsys):
    text = README.read_text()
    section = text[text.index("## Using it"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md (Using it)", "exec"), {"__name__": "readme_example"})
    printed = capsys.readouterr().out.strip()
    tokens = [int(t) for t in re.findall(r"-?\d+", printed)]
    assert len(tokens) == 8 and all(0 <= t < 1000 for t in tokens), printed


PROFILING_README = README.parent / "profiling" / "README.md"


def test_model_table_block_is_replaced_between_its_markers():
    from profiling.model_table import readme_table, with_table
    text = "a\n<!-- model_table: begin (cmd) -->\n| old |\n<!-- model_table: end -->\nb\n"
    new = with_table(text, "| new |\n|---|\n")
    assert new == "a\n<!-- model_table: begin (cmd) -->\n| new |\n|---|\n<!-- model_table: end -->\nb\n"
    assert readme_table(new) == "| new |\n|---|"
    with pytest.raises(ValueError, match="found 0"):
        readme_table("no markers")
    with pytest.raises(ValueError, match="found 2"):
        with_table(text + text, "| x |")


def test_readme_tables_are_generated_or_layout():
    """The product README's only table is the layout table; the profiling README's tables
    are its goals, its file list, the generated model table and the NVTX ranges (figures
    otherwise live in docs/decisions/)."""
    from profiling.model_table import readme_table
    heads = [line for text in (README.read_text(),) for line in _table_heads(text)]
    assert heads == ["| path | what it holds |"], heads
    text = PROFILING_README.read_text()
    assert _table_heads(text) == ["| goal | measured by |", "| file | what it does |",
                                  "| drafter | 2K | 8K | 32K |",
                                  "| DFlash 2 drafter | 2K | without conv / selector | added |",
                                  "| range | colour | what it covers |"]
    assert readme_table(text).startswith("| drafter | 2K | 8K | 32K |")


@pytest.mark.slow
def test_profiling_readme_model_table_is_current():
    """`python -m profiling.model_table --write profiling/README.md` regenerates it."""
    from profiling.model_table import readme_table, table
    # The 2K column only: a third of the models (the suite's longest test; the 8K and 32K
    # columns come from the same code at other windows, and the DFlash 2 table beside it from
    # the same command: docs/decisions/test_time.md)
    readme = readme_table(PROFILING_README.read_text()).splitlines()
    first_column = ["|".join(line.split("|")[:3]) + "|" for line in readme]
    first_column[1] = "|---|---|"
    assert "\n".join(first_column) == table(windows=(2048,)), \
        "the model table is stale: python -m profiling.model_table --write profiling/README.md"


def _table_heads(text: str) -> list[str]:
    lines = text.splitlines()
    return [line.strip() for i, line in enumerate(lines)
            if line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|"))]


def _layout_rows() -> list[str]:
    text = README.read_text()
    section = text[text.index("## Layout"):]
    section = section[:section.index("\n## ", 1)] if "\n## " in section[1:] else section
    return [line for line in section.splitlines() if line.startswith("| `")]


def _named_paths(row: str) -> list[Path]:
    """The paths a layout row names: its first cell's backticked names, each either a path
    from the repository root or a sibling of the row's previous path."""
    first = row.split("|")[1]
    out, base = [], None
    for name in re.findall(r"`([^`]+)`", first):
        name = name.rstrip("/")
        if "*" in name:
            base = Path(name).parent
            out.extend(sorted(p.relative_to(README.parent) for p in (README.parent).glob(name)))
            continue
        p = Path(name)
        if len(p.parts) > 1 and (README.parent / p.parts[0]).exists():
            base = p.parent
        elif base is not None:
            p = base / p
        out.append(p)
    return out


def test_layout_table_matches_the_tree():
    """Every path the layout table names exists, and every product, kernel and profiling
    file is named by a row (itself, or a folder row above it)."""
    root = README.parent
    named = [p for row in _layout_rows() for p in _named_paths(row)]
    missing = [str(p) for p in named if not (root / p).exists()]
    assert not missing, f"the layout table names paths that are not in the tree: {missing}"
    covered = {root / p for p in named}
    files = [*root.glob("dflash_cupy/**/*.py"), *root.glob("cuda_src/*.cu"), *root.glob("cuda_src/*.cuh"),
             *root.glob("profiling/*.py"), *root.glob("profiling/*.sh")]
    unnamed = sorted(str(f.relative_to(root)) for f in files
                     if f.name != "__init__.py" and f not in covered
                     and not any(c.is_dir() and c in f.parents for c in covered))
    assert not unnamed, f"files the README's layout table does not name: {unnamed}"
