"""``profiling/gpu_check.sh`` run with a stand-in python that records, instead of running,
each command line the script would run on a GPU (no GPU needed)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def recorded_commands(tmp_path: Path, *script_args: str, **env_extra: str) -> list[list[str]]:
    """The script's python command lines (argv after the interpreter), in order. The script
    must exit 0; its output is shown when it does not."""
    record = tmp_path / "argv.jsonl"
    stub = tmp_path / "python3"
    stub.write_text("#!/usr/bin/env bash\n"
                    "[[ $1 == -c ]] && { echo stub; exit 0; }\n"
                    'exec "$REAL_PY" -c \'import json, sys; open(sys.argv[1], "a").write('
                    'json.dumps(sys.argv[2:]) + "\\n")\' "$RECORD" "$@"\n')
    stub.chmod(0o755)
    env = dict(os.environ, PYTHON=str(stub), REAL_PY=sys.executable, RECORD=str(record), **env_extra)
    p = subprocess.run(["bash", str(ROOT / "profiling" / "gpu_check.sh"), str(tmp_path / "o"), *script_args],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    return [json.loads(line) for line in record.read_text().splitlines()]
