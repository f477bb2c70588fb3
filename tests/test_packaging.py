"""The installable package: the wheel carries every kernel source, and the
package finds its sources in an installed layout as in the source tree."""
from __future__ import annotations

import ast
import configparser
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _names(text: str) -> set[str]:
    return {r.split(">")[0].split("=")[0].split("<")[0].strip().lower() for r in text.split() if r.strip()}


def _requirements(extras: bool = False) -> set[str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    out = _names(cfg["options"]["install_requires"])
    if extras:
        for text in cfg["options.extras_require"].values():
            out |= _names(text)
    return out


def test_wheel_carries_kernel_sources(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (whl,) = tmp_path.glob("dflash_cupy-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    src = ROOT / "cuda_src"
    want = {f"dflash_cupy/cuda_src/{p.relative_to(src).as_posix()}" for p in src.rglob("*")
            if p.is_file() and p.suffix in (".cu", ".cuh", ".h")}
    assert want and want <= names, sorted(want - names)
    emu = ROOT / "dflash_cupy" / "emu"
    headers = {f"dflash_cupy/emu/{p.relative_to(emu).as_posix()}" for p in emu.rglob("*.h")}
    assert "dflash_cupy/emu/cuda/cuda_emu.h" in headers and "dflash_cupy/emu/cuda/include/cuda_fp16.h" in headers
    assert headers <= names, sorted(headers - names)      # the emulator's headers, split by concern
    assert {"dflash_cupy/emu/README.md", "dflash_cupy/emu/backend.py"} <= names
    assert "dflash_cupy/source_dir.py" in names


def test_installed_layout_is_found_first(tmp_path, monkeypatch):
    """A package directory holding cuda_src/ (the wheel's layout) uses its own copy."""
    import importlib.util
    pkg = tmp_path / "pkg"
    (pkg / "cuda_src").mkdir(parents=True)
    (pkg / "cuda_src" / "k.cu").write_text("// stub\n")
    (pkg / "source_dir.py").write_text((ROOT / "dflash_cupy" / "source_dir.py").read_text())
    monkeypatch.delenv("DFLASH_CUPY_CUDA_SRC", raising=False)
    spec = importlib.util.spec_from_file_location("source_dir_probe", pkg / "source_dir.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.CUDA_SRC == (pkg / "cuda_src").resolve()


def test_missing_sources_raise_a_clear_error(tmp_path, monkeypatch):
    import importlib.util
    (tmp_path / "source_dir.py").write_text((ROOT / "dflash_cupy" / "source_dir.py").read_text())
    monkeypatch.delenv("DFLASH_CUPY_CUDA_SRC", raising=False)
    spec = importlib.util.spec_from_file_location("source_dir_probe2", tmp_path / "source_dir.py")
    mod = importlib.util.module_from_spec(spec)
    with pytest.raises(FileNotFoundError, match="kernel sources not found"):
        spec.loader.exec_module(mod)


# Declared distributions -> the top-level modules they provide; empty: needed
# at run time without an import of ours (CuPy loads NVRTC from that wheel; the
# runtime headers are found through cuda.pathfinder, backends/cuda_headers.py).
_DIST_MODULES = {"numpy": {"numpy"}, "cupy-cuda12x": {"cupy", "cupy_backends", "cupyx"},
                 "safetensors": {"safetensors"}, "ml_dtypes": {"ml_dtypes"}, "nvtx": {"nvtx"},
                 "cuda-pathfinder": {"cuda"}, "nvidia-cuda-nvrtc-cu12": set(),
                 "nvidia-cuda-runtime-cu12": set()}


def _third_party_imports() -> set[str]:
    stdlib = set(sys.stdlib_module_names)
    found = set()
    for f in (ROOT / "dflash_cupy").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module]
            else:
                continue
            found |= {m.split(".")[0] for m in mods} - stdlib - {"dflash_cupy"}
    return found


def test_declared_dependencies_match_imports():
    """Every import of the package is declared (required, or in an extra where
    the import is optional); every required distribution is used."""
    required, everything = _requirements(), _requirements(extras=True)
    unknown = required - set(_DIST_MODULES)
    assert not unknown, f"setup.cfg declares {sorted(unknown)}: add them to _DIST_MODULES with their module"
    provided = set().union(*(_DIST_MODULES[d] for d in required))
    optional = set().union(*(_DIST_MODULES.get(d, {d.replace("-", "_")}) for d in everything))
    imported = _third_party_imports()
    assert imported <= optional, f"imported but not declared: {sorted(imported - optional)}"
    assert provided <= imported, f"declared but never imported: {sorted(provided - imported)}"
