"""profiling/counters.py's static model of the stream GEMMs' two-input launch (``x2``,
``row_split``) and of the folded norm's low rows (``ln_lo``, ``use_ln_lo``) against the
emulator's counter mode on the same recorded launch (every block run).

K = 272: rows of 1088 (f32) and 544 (16-bit) bytes are whole sectors, so a row read from x2 (its
own allocation) costs what the same row of one concatenated matrix does; the model does not
follow sectors shared across a row boundary (K * element size not a multiple of 32 bytes).
gemm_stream's split K at K = 256 (whole x chunks per slice): the emulator builds a warp's
instruction from each lane's n-th execution of a site, so in a loop where some lanes skip a
load (a chunk cut short by the slice's end) it merges lanes of different iterations into one
request; the GPU issues one per iteration, as the model counts."""
import numpy as np
import pytest

from dflash_cupy.ops import gemm_stream as gs
from dflash_cupy.ops.gemm import Gemm
from profiling import counters as ctr
from profiling.emulated_counters import run_counted
from profiling.step_trace import RecordingBackend, _rename

N, K = 136, 272
MAX_M = 200
NAMES = ("x", "x2", "ln", "ln_lo", "w", "pad_lo")
# static bytes_read keys of those arrays (counters.py tags ln_lo's)
ST_KEY = {"ln_lo": "ln_lo (ln_lo)"}


def _launch(cfg, m, split, norm_kind, norm_lo, x16=False, k=K, pad=None):
    """The recorded launch of ``Gemm(...)(x, w, y, m, x2=(x2, split), norm=...)``, its arrays
    named as the kernel's parameters (split >= m: one input, no x2); ``pad=(lo, hi)``: rows
    [lo, hi) are padding (the step's qkv launch: lo = the step's new context rows)."""
    rec = RecordingBackend()
    g = Gemm(rec, N, k, "bf16", max_m=MAX_M, path="stream", x_split=not x16, x16=x16,
             norm_eps=None if norm_kind == "none" else 1e-6)
    g.use_config(m, cfg)
    dt = np.uint16 if x16 else np.float32
    two = split < m
    xa = rec.empty((max(split, 1) if two else m, k), dt)
    xb = rec.empty((m - split, k), dt) if two else None
    y, w = rec.empty((m, N), np.float32), rec.empty((N, k), np.uint16)
    ln, ln_lo = rec.asarray(np.ones(k, np.float32)), rec.asarray(np.ones(k, np.float32))
    norm = {"none": None, "ln": (ln, norm_lo), "ln_lo": (ln, norm_lo, ln_lo)}[norm_kind]
    pad_rows = None if pad is None else (rec.asarray(np.array([pad[0]], np.int32)), pad[1])
    g(xa, w, y, m, x2=(xb, split) if two else None, norm=norm, pad_rows=pad_rows)
    L = rec.eager[-1]
    if pad is not None:
        L.known["pad_lo"] = pad[0]    # as the step plan knows it from the descriptor
    arrays = {"x": xa, "x2": xb, "y": y, "w": w, "ln": ln, "ln_lo": ln_lo,
              "pad_lo": None if pad_rows is None else pad_rows[0]}
    _rename([L], {(int(a.ctypes.data), int(a.nbytes)): n for n, a in arrays.items() if a is not None})
    return L


def _count(L):
    lc, sample, _ = run_counted(L, n=10**6)
    assert len(sample) == L.n_blocks and not getattr(lc, "scaled", False)   # every block ran
    return lc


def _distinct(lc, st, what):
    """Per array (x, x2, ln, ln_lo, w, pad_lo): the emulator's distinct bytes read == the
    model's ``bytes_read``."""
    for name in NAMES:
        a = lc.arrays.get(name)
        emu = a.read_distinct if a is not None else 0
        assert emu == st.bytes_read.get(ST_KEY.get(name, name), 0), \
            f"{what}: distinct bytes read of {name}: emulator {emu}, static {st.bytes_read}"


def _totals(lc) -> tuple:
    return (lc.gld_requests, lc.gld_sectors, lc.gld_bytes, lc.gst_requests, lc.gst_sectors, lc.gst_bytes,
            lc.smem_requests, lc.smem_wavefronts, lc.mma, lc.wgmma_mma, lc.barriers)


def _measure(kernel: str, case):
    """``(launch, static counters, emulator counts, label)`` of a test case ``(variant, k split,
    m, row_split, norm, norm_lo, x16, K[, pad])``."""
    variant, ks, m, split, norm_kind, norm_lo, x16, k, *pad = case
    L = _launch((variant, ks), m, split, norm_kind, norm_lo, x16, k, pad[0] if pad else None)
    assert L.kernel == kernel and L.grid[2] == ks
    return L, ctr.static_counters(L), _count(L), f"{kernel} {case}"


def _same_as_concatenated(lc, case, what):
    """A two-pointer launch: x holds its rows below row_split that are read, and every count
    equals the one-input launch's on [x rows; x2 rows] (the kernels only pick a row's base)."""
    variant, ks, m, split, norm_kind, norm_lo, x16, k, *pad = case
    if split >= m:
        return
    pad = pad[0] if pad else None
    assert lc.arrays["x"].read_distinct == (pad[0] if pad else split) * k * (2 if x16 else 4), what
    one = _totals(_count(_launch((variant, ks), m, m, norm_kind, norm_lo, x16, k, pad)))
    assert _totals(lc) == one, f"{what}: two pointers {_totals(lc)}, one {one}"


def _rmw_unseen(L) -> int:
    """``ss_s[row] += ss`` (gemm_stream.cu, GS_NORM): the GPU issues a shared load and a
    store, the emulator's hooks see one access (the compiler's address-sanitizer pass checks
    the address once per read-modify-write). Per block and x chunk one per staged row (16
    per computed tile: one with a row below M that is not padding; no tile_live here)."""
    if not L.defines.get("GS_NORM") or not L.defines.get("GS_X16"):   # the f32 raw staging keeps lane partials
        return 0
    lo, hi = L.known.get("pad_lo", 0), int(L.arg("pad_hi"))
    M, kt, kz, ROWS, k = int(L.arg("M")), int(L.arg("kt")), int(L.arg("kz")), 16 * L.defines["GS_MT"], L.defines["GS_K"]
    gx = -(-N // (8 * L.defines["GS_WARPS"] * L.defines["GS_NT"]))
    chunks = sum(-(-(-(-min(kz, k - z * kz) // gs.KSTEP)) // (kt // gs.KSTEP)) for z in range(L.grid[2]))
    tiles = sum(1 for a in range(0, M, 16) if any(not lo <= r < hi for r in range(a, min(a + 16, M))))
    return gx * chunks * 16 * tiles


# (mt, k split, m, row_split, norm, norm_lo, x16, K): row_split inside a tile, at a tile's last
# row, >= m (one input)
STREAM = [
    (1, 1, 13, 3, "none", 13, False, K),
    (1, 1, 13, 5, "ln", 7, False, K),
    (1, 1, 13, 13, "ln_lo", 7, False, K),          # one input, ln_lo
    (2, 1, 35, 19, "ln_lo", 21, True, K),
    (4, 1, 35, 33, "ln", 3, False, K),
    (4, 1, 35, 19, "ln_lo", 0, False, K),          # use_ln_lo with no row below norm_lo: ln_lo unread
    (4, 1, 35, 3, "ln_lo", 35, False, K),          # every row from ln_lo: ln unread
    (4, 1, 35, 19, "ln", 35, True, K),             # the norm compiled, no row normalised
    (2, 2, 35, 19, "none", 35, False, 256),        # split K: partial tiles, tickets, the reduction
    (2, 2, 35, 19, "ln_lo", 21, False, 256),       # ... with the slices' row sums
    (1, 2, 35, 3, "ln_lo", 3, True, 256),
]
# the step's qkv launch: 34 context rows of which [6, 34) padding, 16 noise rows from x2
STEP_QKV = (50, 34, "ln_lo", 34, (6, 34))


@pytest.mark.parametrize("case", STREAM + [(4, 1, *STEP_QKV[:4], False, K, STEP_QKV[4]),
                                          (4, 1, *STEP_QKV[:4], True, K, STEP_QKV[4])],
                         ids=lambda c: "-".join(map(str, c)))
def test_gemm_stream_two_inputs_and_ln_lo_match_the_emulator(case):
    """gemm_stream: global requests, sectors and bytes (loads and stores), shared requests and
    wavefronts, MMAs and barriers exactly; per array (x, x2, ln, ln_lo, w) the distinct bytes
    read exactly; a two-pointer launch costs what the one-pointer launch of the concatenated
    rows does."""
    L, st, lc, what = _measure("gemm_stream", case)
    rmw = _rmw_unseen(L)
    for f, emu, model in [
        ("gld_requests", lc.gld_requests, st.gld_requests), ("gld_sectors", lc.gld_sectors, st.gld_sectors),
        ("gld_bytes", lc.gld_bytes, st.gld_bytes), ("gst_requests", lc.gst_requests, st.gst_requests),
        ("gst_sectors", lc.gst_sectors, st.gst_sectors), ("gst_bytes", lc.gst_bytes, st.gst_bytes),
        ("mma", lc.mma, st.mma),
        ("barriers", lc.barriers, st.barriers),
        ("smem_requests", lc.smem_requests + rmw, st.smem_requests),
        ("smem_wavefronts", lc.smem_wavefronts + rmw, st.smem_wavefronts),
        ("smem_ideal_wavefronts", lc.smem_ideal + rmw, st.smem_ideal_wavefronts),
    ]:
        unseen = " (with the stores it cannot see)" if rmw and "smem" in f else ""
        assert emu == model, f"{what}: {f}: emulator {emu}{unseen}, static {model}"
    _distinct(lc, st, what)
    _same_as_concatenated(lc, case, what)


# (variant, k split, m, row_split, norm, norm_lo, x16, K)
WGMMA = [
    ("wg64", 1, 70, 33, "ln_lo", 19, False, K),
    ("wg64", 1, 70, 3, "ln", 19, True, K),
    ("wg64", 1, 70, 70, "ln_lo", 0, False, K),    # one input; ln_lo unread
    ("wg128", 1, 150, 19, "none", 150, False, K),
    ("wg64", 3, 100, 33, "ln_lo", 21, False, 840),   # split K (K 840: 3360-byte rows)
    ("wg64", 1, *STEP_QKV[:4], False, K, STEP_QKV[4]),
    ("wg64", 1, *STEP_QKV[:4], True, K, STEP_QKV[4]),
]


@pytest.mark.parametrize("case", WGMMA, ids=lambda c: "-".join(map(str, c)))
def test_gemm_wgmma_two_inputs_and_ln_lo_match_the_emulator(case):
    """gemm_wgmma: wgmma work and B bytes, barriers, global store sectors and bytes (split K:
    and requests) exactly, per array distinct bytes exactly, the staging stores (no norm)
    exactly; global load sectors other than the gammas' within 2% (the model counts x per
    token, not per partial warp, and a gamma once per block and step: its re-reads by the other
    tokens are L1 hits, the emulator counts each); a two-pointer launch costs what the
    one-pointer launch of the concatenated rows does."""
    L, st, lc, what = _measure("gemm_wgmma", case)
    _, ks, m, _, norm_kind, *_ = case
    exact = ("wgmma_mma", "wgmma_smem_bytes", "barriers", "gst_sectors", "gst_bytes")
    for f in exact + (("gst_requests",) if ks > 1 else ()):
        assert getattr(lc, f) == getattr(st, f), f"{what}: {f}: emulator {getattr(lc, f)}, static {getattr(st, f)}"
    _distinct(lc, st, what)
    if norm_kind == "none":
        assert (lc.sst_requests, lc.sst_wavefronts) == (st.smem_requests, st.smem_wavefronts), what
    # the gammas' sectors: the emulator's per array, the model's = this launch less the same
    # launch with no row normalised (norm_lo = m, use_ln_lo 0)
    gam_emu = sum(lc.arrays[a].ld_sectors for a in ("ln", "ln_lo") if a in lc.arrays)
    if norm_kind != "none":
        plain = ctr.static_counters(L.with_args(norm_lo=m, use_ln_lo=0))
        gam_st = st.gld_sectors - plain.gld_sectors
        assert (gam_emu > 0) == (gam_st > 0), what
    else:
        gam_st = 0
    emu, model = lc.gld_sectors - gam_emu, st.gld_sectors - gam_st
    assert abs(emu - model) <= 0.02 * model, f"{what}: gld_sectors without the gammas: emulator {emu}, static {model}"
    _same_as_concatenated(lc, case, what)


def test_gamma_bytes_follow_the_rows_that_read_them():
    """The model's ln / ln_lo bytes (and compulsory HBM bytes): ln when a row >= norm_lo is
    normalised, ln_lo when a row below it is (use_ln_lo), neither when no row is."""
    both = ctr.static_counters(_launch((4, 1), 35, 19, "ln_lo", 21))
    assert both.bytes_read["ln"] == both.bytes_read["ln_lo (ln_lo)"] == K * 4
    no_lo = ctr.static_counters(_launch((4, 1), 35, 19, "ln_lo", 0))
    assert "ln_lo (ln_lo)" not in no_lo.bytes_read and no_lo.bytes_read["ln"] == K * 4
    assert both.dram_bytes - no_lo.dram_bytes == K * 4
    none = ctr.static_counters(_launch(("wg64", 1), 70, 33, "ln", 70))
    assert "ln" not in none.bytes_read
    assert none.dram_bytes == ctr.static_counters(_launch(("wg64", 1), 70, 33, "none", 70)).dram_bytes
