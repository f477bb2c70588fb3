"""The small-M weight-streaming GEMM alone, over the drafter's real weight shapes.

For each weight shape of the drafter (fc, [k;v], [q;k;v], o, [gate;up] with
the SiLU epilogue, down; the LM head with ``--lm-head``) and each M in
``--ms`` (16 = q_len, 34 = a_step, 64 = one full M tile): time per call,
compulsory bytes (``Gemm.bytes_moved``), GB/s and the fraction of the copy
bandwidth measured in the same run. Timing is graph-amortised: one captured
graph launches the GEMM over ``copies`` different weight copies (enough to
exceed 4x the L2, so weights stream from HBM as they do in the real step),
and the graph replay time is divided by ``copies``.

Each row names the launch configuration it ran (``Gemm.config``: an mma.sync M
variant or a wgmma one, and the K split); ``--mma-sync`` adds the same shapes
with the mma.sync kernel forced (``wgmma=False``) beside the default.

On a GPU, cuBLAS through ``cupy.matmul`` is timed side by side on the same
shapes with f16 operands (same weight bytes as bf16; CuPy has no bf16): x
``[M, K]`` @ W ``[K, N]`` -> ``[M, N]``, the ``[gate;up]`` shape as one
``[K, 2N]`` product without the epilogue. It is captured into a graph too
when cuBLAS allows it, else timed eagerly (the JSON says which).

    python -m profiling.bench_gemm                  # Qwen3.5-27B drafter shapes (GPU)
    python -m profiling.bench_gemm --smoke          # tiny shapes (CI, emulator)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from dflash_cupy import backends
from dflash_cupy.step_engine import GEMM_MAX_M as MAX_M
from dflash_cupy.ops.gemm import Gemm
from profiling import common, timer

MAX_COPIES = 32


def gemm_shapes(cfg, lm_head: int = 0) -> list[tuple[str, int, int, str]]:
    """(name, N, K, epilogue) of every GEMM the drafter step runs."""
    H, kvw = cfg.hidden_size, cfg.kv_dim
    s = [("fc", H, cfg.fc_in, "none"), ("kv", 2 * kvw, H, "none"),
         ("qkv", cfg.q_dim + 2 * kvw, H, "none"), ("o", H, cfg.q_dim, "residual"),
         ("gate_up", cfg.intermediate_size, H, "silu_mul"), ("down", H, cfg.intermediate_size, "residual")]
    if lm_head:
        s.append(("lm_head", int(lm_head), H, "none"))
    return s


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m profiling.bench_gemm", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(p, json_default_name="bench_gemm.json")
    p.add_argument("--drafter", default=None, help="preset (default qwen3.5-27b; smoke: tiny)")
    p.add_argument("--ms", default="16,34,64", help="M values (default 16,34,64)")
    p.add_argument("--shapes", default=None, help="subset of fc,kv,qkv,o,gate_up,down,lm_head")
    p.add_argument("--lm-head", type=int, default=0, metavar="VOCAB", help="also the LM head shape")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--budget-s", type=float, default=3.0, help="per (shape, M) sampling budget")
    p.add_argument("--no-cublas", action="store_true", help="skip the cupy.matmul comparison")
    p.add_argument("--mma-sync", action="store_true",
                   help="also time gemm_stream.cu alone (wgmma=False) beside the default, which takes the "
                        "wgmma kernel from 49 rows on an sm_90a device (impl 'dflash_mma_sync')")
    a = p.parse_args(argv)
    a.drafter = a.drafter or ("tiny" if a.smoke else common.DEFAULT_DRAFTER)
    common.drafter_config(a.drafter)
    a.ms = common.int_list(a.ms)
    a.shapes = common.str_list(a.shapes) if a.shapes else None
    a.warmup = a.warmup if a.warmup is not None else (1 if a.smoke else 3)
    a.repeats = a.repeats if a.repeats is not None else (3 if a.smoke else 20)
    return a


def n_copies(be, weight_bytes: int) -> int:
    l2 = timer.l2_bytes(be)
    if l2 <= 0:
        return 1
    return int(max(1, min(MAX_COPIES, -(-4 * l2 // max(weight_bytes, 1)))))


def bench_ours(be, name, N, K, epi, ms, args, bw_Bps, seed, wgmma=None) -> list[dict]:
    g = Gemm(be, N, K, "bf16", epi, max_m=max(MAX_M, max(ms)), wgmma=wgmma)
    copies = n_copies(be, g.bytes_moved(0))
    ws = [common.random_bf16(be, (g.w_rows, K), scale=K ** -0.5, seed=seed + i) for i in range(copies)]
    mmax = max(ms)
    x = common.random_f32(be, (mmax, K), seed=seed + 1000)
    y = common.random_f32(be, (mmax, N), seed=seed + 1001)
    stream = be.stream()
    rows = []
    for m in ms:
        res = y if epi == "residual" else None

        def launch_all():
            for w in ws:
                g(x, w, y, m, residual=res, stream=stream)

        graph = timer.capture(be, stream, launch_all)
        t = timer.measure(lambda: graph.launch(stream), be, stream=stream, warmup=args.warmup,
                          repeats=args.repeats, budget_s=args.budget_s)
        per = t.median_s / copies
        by = g.bytes_moved(m)
        out = be.to_numpy(y)[:m]
        rows.append({"impl": "dflash" if wgmma is None else "dflash_mma_sync", "shape": name, "N": N, "K": K,
                     "epilogue": epi, "M": m, "config": list(g.config(m)),
                     "w_rows": g.w_rows, "copies": copies, "us": per * 1e6, "bytes": by,
                     "weight_bytes": g.bytes_moved(0), "GBps": by / per / 1e9,
                     "frac_of_copy_bw": by / per / bw_Bps, "timing": t.as_dict(),
                     "graph_launches": copies, "out_finite": bool(np.isfinite(out).all()),
                     "tiling": repr(g)})
    del ws, x, y
    return rows


def bench_cublas(be, name, N, K, epi, ms, args, bw_Bps, seed) -> list[dict]:
    import cupy
    Nw = 2 * N if epi == "silu_mul" else N
    wbytes = K * Nw * 2
    copies = n_copies(be, wbytes)
    ws = [common.random_f16(be, (K, Nw), scale=K ** -0.5, seed=seed + i) for i in range(copies)]
    mmax = max(ms)
    x = common.random_f16(be, (mmax, K), seed=seed + 1000)
    y = cupy.empty((mmax, Nw), cupy.float16)
    stream = cupy.cuda.Stream(non_blocking=True)
    rows = []
    for m in ms:
        xm, ym = x[:m], y[:m]

        def launch_all():
            for w in ws:
                cupy.matmul(xm, w, out=ym)

        method = "graph"
        with stream:
            launch_all()  # warm cuBLAS (handle, workspace, heuristics) before capture
            stream.synchronize()
            try:
                stream.begin_capture()
                try:
                    launch_all()
                finally:
                    graph = stream.end_capture()
                fn = lambda: graph.launch(stream)  # noqa: E731
                fn()
                stream.synchronize()
            except Exception as e:
                method = f"eager ({type(e).__name__}: {str(e)[:120]})"
                fn = launch_all
            t = timer.measure(fn, be, stream=stream, warmup=args.warmup, repeats=args.repeats,
                              budget_s=args.budget_s)
        per = t.median_s / copies
        by = wbytes + m * K * 2 + m * Nw * 2
        rows.append({"impl": "cublas_f16", "shape": name, "N": Nw, "K": K, "epilogue": "none",
                     "M": m, "copies": copies, "us": per * 1e6, "bytes": by, "weight_bytes": wbytes,
                     "GBps": by / per / 1e9, "frac_of_copy_bw": by / per / bw_Bps,
                     "timing": t.as_dict(), "method": method})
    del ws, x, y
    return rows


TABLE = [("shape", "shape", ""), ("impl", "impl", ""), ("M", "M", "d"), ("N", "N", "d"), ("K", "K", "d"),
         ("us", "us", ".2f"), ("GBps", "GB/s", ".0f"), ("frac_of_copy_bw", "of copy bw", ".2f"),
         ("copies", "copies", "d")]


def main(argv=None) -> dict:
    args = parse_args(argv)
    be = backends.get(args.backend)
    out = Path(args.out) if args.out else common.default_out(be, "bench_gemm.json")
    cfg = common.drafter_config(args.drafter)
    shapes = gemm_shapes(cfg, args.lm_head)
    if args.shapes:
        unknown = set(args.shapes) - {s[0] for s in shapes}
        if unknown:
            raise SystemExit(f"--shapes: unknown {sorted(unknown)}")
        shapes = [s for s in shapes if s[0] in args.shapes]
    print(f"bench_gemm: backend={be.name} drafter={args.drafter} M={args.ms} -> {out}", flush=True)
    result, bw = common.start_result("gemm", be, args, argv, f"; L2 {timer.l2_bytes(be)} B")
    result.update({"drafter": args.drafter, "config": common.config_summary(cfg), "rows": []})
    cublas = be.name == "cuda" and not args.no_cublas
    for i, (name, N, K, epi) in enumerate(shapes):
        rows = bench_ours(be, name, N, K, epi, args.ms, args, bw, args.seed + 97 * i)
        if args.mma_sync:
            rows += bench_ours(be, name, N, K, epi, args.ms, args, bw, args.seed + 97 * i, wgmma=False)
        if cublas:
            try:
                rows += bench_cublas(be, name, N, K, epi, args.ms, args, bw, args.seed + 97 * i)
            except Exception as e:
                rows.append({"impl": "cublas_f16", "shape": name, "error": f"{type(e).__name__}: {e}"})
        common.print_rows(f"{name:>8}", rows)
        common.add_rows(result, rows, out, be)
    return common.finish(result, out, TABLE)


if __name__ == "__main__":
    main()
