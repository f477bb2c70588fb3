"""The package's layering, read from the source (every import, module level
or inside a function): no import cycle between modules, no import from a
lower layer into a higher one (kernels' launchers <- the product <- demo and
benchmarks), and the product never imports the float64 oracle."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "dflash_cupy"

# The product: what a pipeline runs (modules, or packages with everything in them).
# It may not import the oracle or the demos.
PRODUCT = ("dflash_cupy.backends", "dflash_cupy.build_cache", "dflash_cupy.checks", "dflash_cupy.config", "dflash_cupy.device_props",
           "dflash_cupy.device_weights", "dflash_cupy.dtypes", "dflash_cupy.emu", "dflash_cupy.feature_ring",
           "dflash_cupy.geometry", "dflash_cupy.interop", "dflash_cupy.kernels", "dflash_cupy.kv_batch",
           "dflash_cupy.kv_cache", "dflash_cupy.kv_pages", "dflash_cupy.mask_rule", "dflash_cupy.memory_plan", "dflash_cupy.nvtx_ranges", "dflash_cupy.ops", "dflash_cupy.rope_params",
           "dflash_cupy.selfcheck_verdict", "dflash_cupy.source_dir",
           "dflash_cupy.step_engine", "dflash_cupy.step_graphs", "dflash_cupy.step_recipe", "dflash_cupy.stream_order", "dflash_cupy.tolerances", "dflash_cupy.tuning",
           "dflash_cupy.weights")
# Not the product: the float64 oracle, the demos and the command line that runs them;
# the package's __init__ only re-exports.
# selfcheck: the device's first-use check compares a cached step with the float64 oracle, so it
# stands beside the oracle; the product reaches it only through selfcheck_verdict's RUNNER.
NOT_PRODUCT = ("dflash_cupy", "dflash_cupy.__main__", "dflash_cupy.demo", "dflash_cupy.lanes_demo",
               "dflash_cupy.reference", "dflash_cupy.selfcheck", "dflash_cupy.spec_demo")
DEMOS = ("dflash_cupy.__main__", "dflash_cupy.demo", "dflash_cupy.lanes_demo", "dflash_cupy.spec_demo")
# layer -> modules (prefixes) it may not import
FORBIDDEN = {
    "dflash_cupy.ops": ("dflash_cupy.kv_cache", "dflash_cupy.feature_ring", "dflash_cupy.weights",
                        "dflash_cupy.device_weights", "dflash_cupy.demo", "dflash_cupy.reference",
                        "profiling"),
    "dflash_cupy.backends": ("dflash_cupy.ops", "dflash_cupy.kv_cache", "dflash_cupy.feature_ring",
                             "dflash_cupy.weights", "dflash_cupy.demo", "profiling"),
    # the emulator (dflash_cupy/emu/): a backend, kernel-agnostic
    "dflash_cupy.emu": ("dflash_cupy.ops", "dflash_cupy.kv_cache", "dflash_cupy.kv_batch", "dflash_cupy.step_engine",
                        "dflash_cupy.feature_ring", "dflash_cupy.weights", "dflash_cupy.kernels", "dflash_cupy.demo",
                        "profiling"),
    "dflash_cupy.kv_cache": ("dflash_cupy.demo", "profiling"),
    "dflash_cupy.kv_batch": ("dflash_cupy.demo", "profiling"),
    # the one step engine: the single cache and the batch are its facades, never the other way
    "dflash_cupy.step_engine": ("dflash_cupy.kv_cache", "dflash_cupy.kv_batch", "dflash_cupy.demo", "profiling"),
    "dflash_cupy.step_recipe": ("dflash_cupy.kv_cache", "dflash_cupy.kv_batch", "dflash_cupy.step_engine",
                                "dflash_cupy.demo", "profiling"),
    "dflash_cupy.step_graphs": ("dflash_cupy.ops", "dflash_cupy.kv_cache", "dflash_cupy.kv_batch",
                                "dflash_cupy.step_engine", "dflash_cupy.demo", "profiling"),
    # the stream order is a leaf: the caches, the batch and the feature ring hold one
    "dflash_cupy.stream_order": ("dflash_cupy.ops", "dflash_cupy.kv_cache", "dflash_cupy.kv_batch",
                                 "dflash_cupy.feature_ring", "dflash_cupy.step_engine", "dflash_cupy.demo", "profiling"),
    "dflash_cupy": ("profiling",),
}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PKG.rglob("*.py")}


def imports(name: str, path: Path, known: set) -> set:
    """The package modules ``name`` imports (``from . import x`` names module x)."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[:len(base) - node.level + 1]
                mod = ".".join(anchor + ([node.module] if node.module else []))
            else:
                mod = node.module
            subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in known]
            out.update(subs or [mod])
    return {m for m in out if m.split(".")[0] in ("dflash_cupy", "profiling")}


GRAPH = {n: imports(n, p, set(modules())) for n, p in modules().items()}


def test_the_graph_sees_the_imports():
    # guards the parser: known edges must show up
    assert "dflash_cupy.device_weights" in GRAPH["dflash_cupy.weights"]
    assert "dflash_cupy.checks" in GRAPH["dflash_cupy.ops.gemm"]
    assert "dflash_cupy.rope_params" in GRAPH["dflash_cupy.step_engine"]
    assert "dflash_cupy.step_engine" in GRAPH["dflash_cupy.kv_cache"]


def test_no_import_cycles():
    # package __init__ files only re-export; their edges are not dependencies
    graph = {n: {m for m in deps if m in GRAPH and not (PKG / "/".join(m.split(".")[1:]) / "__init__.py").is_file()
                 and m != "dflash_cupy"}
             for n, deps in GRAPH.items()}
    state: dict = {}

    def visit(n, stack):
        state[n] = 1
        for m in graph.get(n, ()):
            if state.get(m) == 1:
                cyc = stack[stack.index(m):] + [m]
                pytest.fail("import cycle: " + " -> ".join(cyc))
            if not state.get(m):
                visit(m, stack + [m])
        state[n] = 2

    for n in graph:
        if not state.get(n):
            visit(n, [n])


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_no_import_from_a_higher_layer(layer):
    bad = []
    for name, deps in GRAPH.items():
        if name != layer and not name.startswith(layer + "."):
            continue
        for d in deps:
            if any(d == f or d.startswith(f + ".") for f in FORBIDDEN[layer]):
                bad.append(f"{name} imports {d}")
    assert not bad, bad


def in_product(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in PRODUCT)


def test_every_module_is_product_or_named_otherwise():
    """A new module must be placed: in the product (and so under its rules) or named
    as one of the oracle, the demos or the package's re-exports."""
    assert not set(PRODUCT) & set(NOT_PRODUCT)
    unplaced = sorted(n for n in GRAPH if not in_product(n) and n not in NOT_PRODUCT)
    assert not unplaced, unplaced
    assert all(n in GRAPH for n in NOT_PRODUCT) and all(
        any(n == p or n.startswith(p + ".") for n in GRAPH) for p in PRODUCT)   # no stale names


def test_the_product_never_imports_the_demos():
    bad = [f"{n} imports {d}" for n, deps in GRAPH.items() if in_product(n)
           for d in deps if d in DEMOS]
    assert not bad, bad


def test_the_product_never_imports_the_oracle():
    bad = [f"{n} imports {d}" for n, deps in GRAPH.items()
           if any(n == p or n.startswith(p + ".") for p in PRODUCT)
           for d in deps if d == "dflash_cupy.reference"]
    assert not bad, bad


def test_only_the_backend_factory_imports_the_emulator():
    """The CUDA backend and the shared backend modules (base, signatures, nvrtc_info,
    launch_limits) stand without the emulator; ``backends.get("emulated")`` reaches it."""
    bad = [f"{n} imports {d}" for n, deps in GRAPH.items()
           if n.startswith("dflash_cupy.backends.") for d in deps if d.startswith("dflash_cupy.emu")]
    assert not bad, bad
    assert any(d.startswith("dflash_cupy.emu") for d in GRAPH["dflash_cupy.backends"])


def test_kernels_names_no_backend_but_cuda():
    """kernels.py asks a backend for its compute capability; it does not know the
    emulator's or profiling's recording backend by name."""
    text = (PKG / "kernels.py").read_text()
    assert '"recording"' not in text and '"emulated"' not in text
