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
                                  "| drafter | 2K | 8K | 32K |", "| range | colour | what it covers |"]
    assert readme_table(text).startswith("| drafter | 2K | 8K | 32K |")


@pytest.mark.slow
def test_profiling_readme_model_table_is_current():
    """`python -m profiling.model_table --write profiling/README.md` regenerates it."""
    from profiling.model_table import readme_table, table
    assert readme_table(PROFILING_README.read_text()) == table(), \
        "the model table is stale: python -m profiling.model_table --write profiling/README.md"


def _table_heads(text: str) -> list[str]:
    lines = text.splitlines()
    return [line.strip() for i, line in enumerate(lines)
            if line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|"))]
