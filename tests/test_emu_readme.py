"""The emulator's README (dflash_cupy/emu/README.md): its worked example runs as
written and prints what the README shows, and its file table matches the package."""
import re
from pathlib import Path

EMU = Path(__file__).resolve().parent.parent / "dflash_cupy" / "emu"
README = EMU / "README.md"


def test_the_worked_example_runs_as_shown(capsys):
    text = README.read_text()
    code = re.search(r"## Running your own kernel\n.*?```python\n(.*?)```", text, re.S).group(1)
    shown = re.search(r"Output:\n\n```\n(.*?)```", text, re.S).group(1).splitlines()
    exec(compile(code, "dflash_cupy/emu/README.md (Running your own kernel)", "exec"), {"__name__": "emu_readme"})
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(shown) == 3, out
    assert out[0] == shown[0] == "True" and out[2] == shown[2] == "True"
    # which out-of-range thread faults first follows the fibers' order (so do its address,
    # its distance past the end and its byte offset); the rest of the report is as shown
    varies = re.compile(r"0x[0-9a-f]+|\d+ bytes past|byte offset \d+|thread \(\d+,0,0\)")
    assert varies.sub("?", out[1]) == varies.sub("?", shown[1])
    t = int(re.search(r"thread \((\d+),0,0\)", out[1]).group(1))
    # row 3 of n = 301 reads x[903 + i]; x holds 1200 floats: threads whose third element
    # i = t + 256 (< 301) is past the end, t = 41..44, are the ones that overrun
    assert 41 <= t <= 44, out[1]


def test_the_file_table_names_every_file():
    files = README.read_text().split("## Files", 1)[1]
    listed = set(re.findall(r"^\| `([^`]+)` \|", files, re.M))
    have = {p.relative_to(EMU).as_posix() for p in EMU.rglob("*") if p.is_file()
            and p.suffix in (".py", ".h") and p.name != "__init__.py" and "/include/" not in f"/{p.parent.relative_to(EMU).as_posix()}/"}
    assert listed == have, (sorted(listed - have), sorted(have - listed))


def test_every_setting_it_lists_is_read_by_the_code():
    text = README.read_text()
    settings = set(re.findall(r"^\| `(DFLASH_CUPY_EMU_[A-Z_]+)` \|", text, re.M))
    code = "".join(p.read_text() for p in EMU.parent.rglob("*.py"))
    assert len(settings) >= 8 and all(f'"{v}"' in code for v in settings), settings
