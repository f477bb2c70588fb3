"""The README's "Using it" example runs as written (on the default backend)."""
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_using_it_example_runs(capsys):
    text = README.read_text()
    section = text[text.index("## Using it"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md (Using it)", "exec"), {"__name__": "readme_example"})
    printed = capsys.readouterr().out.strip()
    tokens = [int(t) for t in re.findall(r"-?\d+", printed)]
    assert len(tokens) == 8 and all(0 <= t < 1000 for t in tokens), printed
