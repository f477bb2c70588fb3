"""The emulator's build cache (``emu/build.py``) shared by concurrent
processes (pytest-xdist workers): the same variant requested by two processes at
once is compiled once, both get the finished module, and it runs; the
precompiled emulator header is the one g++ really reads; the emulator's runtime
is compiled once, not again in each module's translation unit; NVRTC's records are
compiled once when two ask at once."""
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

from dflash_cupy.emu import build as emu_build

ROOT = Path(__file__).resolve().parent.parent

SRC = r"""
extern "C" __global__ void add_one(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
}
"""

# One process: wait for the go file, build the module, load it on the emulated
# backend, launch it, print the module's path and the result's sum.
CHILD = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import numpy as np
    from dflash_cupy import backends
    from dflash_cupy.emu import build as emu_build
    src = open(sys.argv[2]).read()
    Path(sys.argv[1] + "." + str(os.getpid())).write_text("ready")
    go = Path(sys.argv[1])
    while not go.exists():
        time.sleep(0.01)
    so, _ = emu_build.build(src, ("-DTWO_PROCESSES=1",), "two_processes.cu")
    be = backends.get("emulated")
    k = be.compile(src, ("-DTWO_PROCESSES=1",), filename="two_processes.cu").get_function("add_one")
    x = be.asarray(np.arange(100, dtype=np.float32))
    k((1,), (128,), (x, np.int32(100)))
    print(so, float(be.to_numpy(x).sum()))
""")

# g++ that records each compile it is asked for, and takes its time (so that the
# second process asks while the first is still compiling).
CXX_WRAPPER = """#!/bin/sh
echo "$@" >> "{log}"
sleep 1
exec g++ "$@"
"""


def test_two_processes_building_the_same_variant_compile_it_once(tmp_path):
    cache, log, go = tmp_path / "cache", tmp_path / "gxx.log", tmp_path / "go"
    wrapper = tmp_path / "gxx"
    wrapper.write_text(CXX_WRAPPER.format(log=log))
    wrapper.chmod(0o755)
    (tmp_path / "src.cu").write_text(SRC)
    (tmp_path / "child.py").write_text(CHILD)
    env = {**os.environ, "DFLASH_CUPY_EMU_CACHE": str(cache), "DFLASH_CUPY_CXX": str(wrapper),
           "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "child.py"), str(go), str(tmp_path / "src.cu")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for _ in range(2)]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("go.*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)            # both imported and waiting on the go file
    go.write_text("go")
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    results = [out.split() for out, _ in outs]
    assert results[0] == results[1], results                       # the same module, the same result
    so, total = Path(results[0][0]), float(results[0][1])
    assert total == float(np.arange(100).sum() + 100)
    assert so.is_file() and so.parent.parent == cache
    compiles = log.read_text().splitlines()
    outputs = [c.split()[-1] for c in compiles]      # what each compile writes (-o)
    modules = [o for o in outputs if o.endswith("module.so")]
    headers = [o for o in outputs if o.endswith(".gch")]
    runtimes = [o for o in outputs if o.endswith(emu_build.RT_OBJECT)]
    assert len(compiles) == 3, compiles
    assert len(modules) == 1, compiles          # the second process waited for the first one's build
    assert len(headers) == 1, compiles          # the precompiled header too
    assert len(runtimes) == 1, compiles         # and the runtime object
    # nothing half-built or temporary is left beside the finished entries
    left = sorted(p.name for p in cache.iterdir() if p.name not in (".locks", "pch", "rt", "nvrtc"))
    assert left == [so.parent.name], left
    for d in ("pch", "rt"):
        assert [p.name for p in (cache / d).iterdir() if "." in p.name] == [], d


def test_the_precompiled_header_is_used(tmp_path, monkeypatch):
    """g++ -H marks a precompiled header it reads with '!' (and one it rejects with 'x'):
    a module's build must read the .gch, not parse cuda_emu.h again."""
    monkeypatch.setenv("DFLASH_CUPY_EMU_CACHE", str(tmp_path))
    flags = emu_build._flags()
    pch = emu_build.precompiled_header(flags)
    assert (pch / (emu_build.PCH_HEADER + ".gch")).is_file()
    (tmp_path / "k.cu").write_text(SRC)
    tu = tmp_path / "tu.cpp"
    tu.write_text(emu_build.generate_tu(tmp_path / "k.cu", emu_build.parse_kernels(SRC), {}))
    r = subprocess.run([emu_build.CXX, *flags, "-Winvalid-pch", "-H", f"-I{pch}", f"-I{emu_build.EMU_DIR}",
                        f"-I{emu_build.EMU_DIR / 'include'}", str(tu), str(emu_build.runtime_object(flags)),
                        "-o", str(tmp_path / "m.so")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"! {pch / emu_build.PCH_HEADER}.gch" in r.stderr, r.stderr[:2000]
    after = r.stderr.split(".gch", 1)[1][:2000]
    assert "cuda_emu.h" not in after and "emu_fibers.h" not in after   # its parts: not parsed as text after it


def _symbols(path: Path) -> dict[str, str]:
    r = subprocess.run(["nm", "-C", str(path)], capture_output=True, text=True, check=True)
    return {line[19:].split("(")[0]: line[17] for line in r.stdout.splitlines() if len(line) > 19}


SHFL_SRC = r"""
extern "C" __global__ void warp_sum(float* x) {
    float v = x[threadIdx.x];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    x[threadIdx.x] = v;
}
"""


def test_the_runtime_is_compiled_once_not_in_each_module(tmp_path, monkeypatch):
    """A module's translation unit declares the emulator's runtime (block runner, scheduler,
    warp collectives, the memory checks' entry points) and links the object built once per
    flag set: g++ does not generate that code again for every kernel."""
    monkeypatch.setenv("DFLASH_CUPY_EMU_CACHE", str(tmp_path))
    flags = emu_build._flags()
    rt = emu_build.runtime_object(flags)
    assert rt == emu_build.runtime_object(flags) and rt.parent.parent == tmp_path / "rt"
    src = SRC + SHFL_SRC
    (tmp_path / "k.cu").write_text(src)
    tu = tmp_path / "tu.cpp"
    tu.write_text(emu_build.generate_tu(tmp_path / "k.cu", emu_build.parse_kernels(src), {}))
    obj = tmp_path / "tu.o"
    r = subprocess.run([emu_build.CXX, *emu_build._compile_only(flags), "-c",
                        f"-I{emu_build.precompiled_header(flags)}", f"-I{emu_build.EMU_DIR}",
                        f"-I{emu_build.EMU_DIR / 'include'}", str(tu), "-o", str(obj)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    kernel, runtime = _symbols(obj), _symbols(rt)
    for name in ("emu::launch", "emu::warp_collective", "__asan_load4_noabort", "emu::tl_fiber"):
        assert kernel.get(name) == "U", (name, kernel.get(name))    # used, defined elsewhere
        assert runtime.get(name, "U") != "U", name                  # defined by the runtime object
    assert "emu::run_blocks" not in kernel and "emu::run_blocks" in runtime


def test_two_threads_asking_nvrtc_for_the_same_source_compile_it_once(tmp_path, monkeypatch):
    """NVRTC's records (``<cache>/nvrtc``) are filled under the same per-key lock as the
    modules: a second asker (another worker, or the emulator's NVRTC thread) waits for the
    record being compiled rather than compiling it again."""
    import threading
    from dflash_cupy.backends import nvrtc_info
    monkeypatch.setenv("DFLASH_CUPY_EMU_CACHE", str(tmp_path / "cache"))
    real, calls = nvrtc_info.compile_info, []

    def slow_compile(*a, **kw):
        calls.append(a[1])
        time.sleep(0.5)          # the second thread asks while this compile runs
        return real(*a, **kw)
    monkeypatch.setattr(nvrtc_info, "compile_info", slow_compile)
    got = []
    threads = [threading.Thread(target=lambda: got.append(nvrtc_info.cached_compile_info(SRC, "once.cu")))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == ["once.cu"], calls
    assert len(got) == 2 and got[0].kernels == got[1].kernels and "add_one" in got[0].kernels
    # the record and the build's cubin (kept for profiling.sass); no temporaries left
    assert sorted(p.suffix for p in (tmp_path / "cache" / "nvrtc").iterdir()) == [".cubin", ".json"]


def test_the_resource_check_and_the_sass_share_one_nvrtc_compile(tmp_path, monkeypatch):
    """``profiling.sass`` disassembles the cubin of the very compile whose resources the
    emulator checks: once a record exists, asking for its SASS compiles nothing; a record
    written without its cubin (an older cache) is compiled once more, then both are kept."""
    from dflash_cupy.backends import nvrtc_info
    from profiling import sass
    monkeypatch.setenv("DFLASH_CUPY_EMU_CACHE", str(tmp_path / "cache"))
    real, calls = nvrtc_info.compile_info, []

    def counted(*a, **kw):
        calls.append(a[1])
        return real(*a, **kw)
    monkeypatch.setattr(nvrtc_info, "compile_info", counted)
    info = nvrtc_info.cached_compile_info(SRC, "shared.cu")
    text = sass.sass_of_source(SRC, "shared.cu")
    assert calls == ["shared.cu"], calls
    assert "add_one" in text and "add_one" in info.kernels
    assert "add_one" in sass._analysed(text)   # the line-annotated disassembly parses
    assert 'shared.cu", line 3' in text   # -lineinfo: each instruction's source line
    for p in (tmp_path / "cache" / "nvrtc").glob("*.cubin"):   # an older cache: records only
        p.unlink()
    elf = nvrtc_info.cached_cubin(SRC, "shared.cu")
    assert calls == ["shared.cu", "shared.cu"] and elf[:4] == b"\x7fELF"
    assert nvrtc_info.cached_cubin(SRC, "shared.cu") == elf and len(calls) == 2
