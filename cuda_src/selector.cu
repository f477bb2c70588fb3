// selector.cu — the DFlash 2 candidate selector (SPEC §6): per-row top-K candidates, then
// the walk over their edge scores. ops/selector.py holds the launchers and NumPy references.
//
// Sizes (-D): SEL_V vocab, SEL_K candidates (<= 64), SEL_Q q_len, SEL_H hidden, SEL_RANK rank,
// SEL_HPT / SEL_CBT weight type of hidden_projection / the codebooks (0 f32, 1 f16, 2 bf16 bits),
// SEL_MULT output_multiplier, SEL_CAP softcap (0: none). R = SEL_Q - 1 selector rows per lane.
// Candidate order: (float_order.cuh key of the raw logit, then lower id) — +inf first, NaN last.
// A pair's rank word is key << 32 | (0xffffffff - id); 0 is the empty slot (below every pair).
// selector_topk_blocks: grid (nblk, lanes * R), block TK_NT; row g = lane * R + j reads logits
//   row lane * row_stride + row0 + j, columns [b * TK_TILE, +TK_TILE). Writes the column block's
//   K best as part [lanes * R][nblk][K][2] u32 (order key, id), best first, empty slots (0,
//   0xffffffff): what a GEMM epilogue may write instead (GS_EPI 4; GS_EPI 3's argmax: K = 1).
// selector_topk_merge: grid lanes * R, block TK_NT: the K best of the row's nblk * K pairs (row g =
//   lane * R + j reads part row lane * prow_stride + prow0 + j: gemm_stream.cu GS_EPI 4 writes
//   every GEMM row) -> ids [lanes * R, K] int32, vals [lanes * R, K] f32 = softcap(logit * MULT)
//   (tanhf(v / CAP) * CAP): the K lists with the best heads (warp rounds, finalists ranked),
//   then their K * K pairs ranked by count. nblk <= NBLK_MAX (SEL_PBLK: such partials' blocks).
// selector_project_merge: grid (SPLIT + merge_rows, lanes), SPLIT = ceil(RANK / WK_NW), merge_rows
//   R or 0. Block x < SPLIT: warp w computes hp[lane][j][x * WK_NW + w] into hp_ws [lanes, R, RANK]
//   f32 (warp_dot); the others merge the lane's row x - SPLIT (the merge's arguments first).
// selector_edges_walk: grid (max(R * ESPLIT, 1), lanes), after it. Blocks j * ESPLIT..: row j's
//   edges [lanes, R, K, K] f32, [i][c] = vals[j][c] + warp_dot(succ_cb[ids[j][c]], u_i), u_i[k] =
//   cb(pred_cb[p_i][k]) * hp[j][k] (f32), p_i = the anchor (j = 0, i = 0) or ids[j - 1][i]. The
//   lane's last block to arrive (arrive.cuh, counters [lanes] int32, zero between launches, reset
//   here) walks in warp 0: anchor a = anchors[lane] (int32; outside [0, V): clamped, flags[lane]
//   = 1); tokens [lanes, Q] int32: row 0 = a, row j+1 = ids[j][choice[j]], row j's scores =
//   edges[j][choice[j - 1]] (j = 0: [0]). knobs f32 [3] (sample.cu's block): T = knobs[0] <= 0:
//   the first largest order key; T > 0: z = score / T, masses draw_mass(z, max z) (draw.cuh),
//   target = draw_target(row_bits64(lane * Q + j + 1, rng), total), the first c whose running
//   mass exceeds it (total 0: choice 0, q row 0). per_lane 1: knobs [lanes][3], rng [lanes][2],
//   row j + 1 (a one-lane walk each). q [lanes, R, K] f32 = f32(mass) / f32(total) (one-hot at
//   T <= 0), choice [lanes, R] int32; hidden [lanes, >= Q, H] f32 (rows 1..Q-1), hp_w [RANK, H],
//   codebooks [V, RANK]. The serial walk holds no dot product, no global load.
// warp_dot(w, x) (ops/selector.py mirrors it): lane i sums w[e] * x[e] in f32 without contraction
//   over its chunks of 8 (i, i + 32, ...) ascending, then warp.cuh's warp_sum butterfly.
// nvrtc-check: -DSEL_V=202048 -DSEL_K=16 -DSEL_Q=16 -DSEL_H=6656 -DSEL_RANK=256 -DSEL_HPT=2 -DSEL_CBT=2 -DSEL_MULT=0.196 -DSEL_CAP=20.0
// nvrtc-check: -DSEL_V=202048 -DSEL_K=16 -DSEL_Q=16 -DSEL_H=6656 -DSEL_RANK=256 -DSEL_HPT=2 -DSEL_CBT=2 -DSEL_MULT=0.196 -DSEL_CAP=20.0 -DSEL_PBLK=790
// nvrtc-check: -DSEL_V=19 -DSEL_K=3 -DSEL_Q=1 -DSEL_H=12 -DSEL_RANK=5 -DSEL_HPT=0 -DSEL_CBT=1 -DSEL_MULT=1.0 -DSEL_CAP=0
// nvrtc-check: -DSEL_V=151936 -DSEL_K=16 -DSEL_Q=16 -DSEL_H=5120 -DSEL_RANK=256 -DSEL_HPT=2 -DSEL_CBT=2 -DSEL_MULT=0.196 -DSEL_CAP=20.0 -DSEL_PBLK=594

#ifndef SEL_V
#define SEL_V 1000
#endif
#ifndef SEL_K
#define SEL_K 16
#endif
#ifndef SEL_Q
#define SEL_Q 16
#endif
#ifndef SEL_H
#define SEL_H 64
#endif
#ifndef SEL_RANK
#define SEL_RANK 16
#endif
#ifndef SEL_HPT
#define SEL_HPT 2
#endif
#ifndef SEL_CBT
#define SEL_CBT 2
#endif
#ifndef SEL_MULT
#define SEL_MULT 1.0
#endif
#ifndef SEL_CAP
#define SEL_CAP 0
#endif

#if SEL_K < 1 || SEL_K > SEL_V
#error "SEL_K must be in [1, SEL_V]"
#endif
#if SEL_Q < 1 || SEL_Q > 64
#error "SEL_Q must be in [1, 64]"
#endif

// Launch shapes (read by ops/selector.py through kernels.constants).
#define SEL_TK_NT 256      // threads of both top-K kernels
#define SEL_TK_PER 16      // columns per thread in selector_topk_blocks (K block-wide rounds per
                           // block whatever the tile: wide tiles make fewer blocks and rounds)
#define SEL_WK_NW 8        // warps of selector_project_merge / selector_edges_walk
#define SEL_MAX_K 64

#if SEL_K > SEL_MAX_K
#error "SEL_K must be <= SEL_MAX_K"
#endif

#include "arrive.cuh"
#include "bits16.cuh"
#include "draw.cuh"
#include "float_order.cuh"
#include "pdl.cuh"
#include "warp.cuh"

namespace selector_detail {
constexpr int V = SEL_V, K = SEL_K, Q = SEL_Q, R = SEL_Q - 1, H = SEL_H, RANK = SEL_RANK;
constexpr int RA = R > 0 ? R : 1;  // register arrays need a positive size
constexpr int TK_NT = SEL_TK_NT, TK_PER = SEL_TK_PER, TK_TILE = TK_NT * TK_PER, TK_NW = TK_NT / 32;
constexpr int WK_NW = SEL_WK_NW, WK_NT = WK_NW * 32;
// selector_topk_merge: list heads per thread (up to NBLK_MAX lists: its own blocks', or SEL_PBLK
// when more) and pairs per thread of the K chosen lists, held in registers
#ifndef SEL_PBLK
#define SEL_PBLK 0
#endif
constexpr int NBLK_OWN = (V + TK_TILE - 1) / TK_TILE, NBLK_MAX = NBLK_OWN > SEL_PBLK ? NBLK_OWN : SEL_PBLK;
constexpr int MH = (NBLK_MAX + TK_NT - 1) / TK_NT, MQ = (K * K + TK_NT - 1) / TK_NT;
// the largest power of two <= K: the merge's binary search over a list of K
constexpr int K_POW2 = K >= 64 ? 64 : K >= 32 ? 32 : K >= 16 ? 16 : K >= 8 ? 8 : K >= 4 ? 4 : K >= 2 ? 2 : 1;
constexpr unsigned long long ALL = ~0ull;
constexpr float MULT = (float)(SEL_MULT), CAP = (float)(SEL_CAP);
constexpr float CAP_DIV = CAP > 0.0f ? CAP : 1.0f;  // (no division by a zero constant when CAP is off)
// selector_edges_walk: each warp holds its candidates' successor rows in registers (CPW rows of
// SCH * 8 values a lane) where they fit in 64; the predecessors' rank vectors u are staged in
// shared memory UI at a time (at most 16 KiB and a block's EPB); every row's K x K edges are
// staged for the walk where they fit in 16 KiB (ESTAGE; else each row reads its chosen
// predecessor's scores from L2).
constexpr int CPW = (K + WK_NW - 1) / WK_NW, SCH = (RANK + 255) / 256;
constexpr bool SREG = CPW * SCH * 8 <= 64;
constexpr bool ESTAGE = RA * K * K * 4 <= 16 * 1024;
// blocks per selector row (each a share of the row's predecessors: more SMs for the dots) and
// the staged edges a walking thread loads at once
constexpr int ESPLIT = K < 4 ? K : 4, EPB = (K + ESPLIT - 1) / ESPLIT;
// (at most a block's EPB predecessors: each u load a thread issues is one it needs, so all of
// them fit ptxas's predicate registers and go out together, one round trip; 16 at K 16 went
// out 4 at a time behind the conversions of the ones before)
constexpr int UI_FIT = (16 * 1024) / (RANK * 4) > 0 ? (16 * 1024) / (RANK * 4) : 1;
constexpr int UI = UI_FIT < EPB ? UI_FIT : EPB;
constexpr int EST = (RA * K * K + WK_NT - 1) / WK_NT;
// whole 16-byte loads of hidden_projection / hidden rows (H) and codebook rows (RANK)
constexpr bool VEC_H = H % 8 == 0, VEC_RANK = RANK % 8 == 0;
// selector_edges_walk's static shared memory, the most of the kernels': the edges' (rank
// vectors, 3 K-arrays), the walk's (staged edges, scores, ids, bits, masses) and the ticket,
// + 16 for u_s's alignment (ops/selector.py checks the same bound first)
static_assert(UI * RANK * 4 + K * 12 + (ESTAGE ? RA * K * K * 4 : 4) + K * 4 + RA * K * 4 + RA * 8 + K * 8 + 4 + 16
              <= 48 * 1024, "selector: the edges' rank vectors and the walk's staging exceed 48 KiB");

__device__ __forceinline__ unsigned long long rank_word(float logit, unsigned int id)
{
    return ((unsigned long long)order_key(logit) << 32) | (0xffffffffu - id);
}

// The block's largest word among each thread's v (every thread gets it).
__device__ __forceinline__ unsigned long long block_max64(unsigned long long v, unsigned long long* red)
{
#pragma unroll
    for (int o = 16; o; o >>= 1) {
        const unsigned long long w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w > v ? w : v;
    }
    __syncthreads();  // red may still be read from the previous round
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    unsigned long long t = 0ull;
    for (int i = 0; i < TK_NW; ++i) t = red[i] > t ? red[i] : t;
    return t;
}

// One round of a block-wide top-K: the largest of every thread's v[0..N) below `last`.
template <int N>
__device__ __forceinline__ unsigned long long block_next_below(const unsigned long long* v, unsigned long long last,
                                                               unsigned long long* red)
{
    unsigned long long mine = 0ull;
#pragma unroll
    for (int i = 0; i < N; ++i)
        if (v[i] < last && v[i] > mine) mine = v[i];
    return block_max64(mine, red);
}

template <int WT>
__device__ __forceinline__ float load_w(const void* p, long long i)
{
    if (WT == 0) return static_cast<const float*>(p)[i];
    return from_bits16<WT>(static_cast<const unsigned short*>(p)[i]);
}

__device__ __forceinline__ const void* cb_row(const void* cb, int id)
{
    return static_cast<const char*>(cb) + (long long)id * RANK * (SEL_CBT ? 2 : 4);
}

// w[e0 .. e0 + 8) as f32: one 16-byte load per 8 16-bit elements (two for f32) when VEC
// (the row and e0 16-byte aligned: whole 8-element chunks of rows whose length is a multiple
// of 8), else element by element (len: the row's end).
template <int WT, bool VEC>
__device__ __forceinline__ void load8_w(const void* w, int e0, int len, float* out)
{
    if (VEC) {
        if (WT == 0) {
            const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(w) + e0);
            const float4 a = p[0], b = p[1];
            out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
            out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
        } else {
            const uint4 v = *reinterpret_cast<const uint4*>(static_cast<const unsigned short*>(w) + e0);
            out[0] = from_bits16<WT>(v.x & 0xffffu); out[1] = from_bits16<WT>(v.x >> 16);
            out[2] = from_bits16<WT>(v.y & 0xffffu); out[3] = from_bits16<WT>(v.y >> 16);
            out[4] = from_bits16<WT>(v.z & 0xffffu); out[5] = from_bits16<WT>(v.z >> 16);
            out[6] = from_bits16<WT>(v.w & 0xffffu); out[7] = from_bits16<WT>(v.w >> 16);
        }
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] = e0 + i < len ? load_w<WT>(w, e0 + i) : 0.0f;
    }
}

// acc[n] = warp_dot(w[0..len), x + n * ldx) for n < N, in every lane (see the header). VEC:
// len, ldx and the bases are multiples of 8 elements / 16 bytes (whole 16-byte loads).
template <int WT, int N, bool VEC>
__device__ __forceinline__ void warp_dot(const void* w, int len, const float* x, int ldx, float* acc)
{
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int n = 0; n < N; ++n) acc[n] = 0.0f;
    for (int c0 = lane * 8; c0 < len; c0 += 256) {
        const int n8 = min(len - c0, 8);
        float we[8];
        load8_w<WT, VEC>(w, c0, len, we);
#pragma unroll
        for (int n = 0; n < N; ++n) {
            float xe[8];
            load8_w<0, VEC>(x + (long long)n * ldx, c0, len, xe);
#pragma unroll
            for (int e = 0; e < 8; ++e)
                if (e < n8) acc[n] = __fadd_rn(acc[n], __fmul_rn(we[e], xe[e]));
        }
    }
    warp_sum_n<N>(acc);
}
// The elements of w[0..len) lane i owns in warp_dot's order, into regs [CH * 8] (0 past len).
template <int WT, int CH, bool VEC>
__device__ __forceinline__ void warp_load(const void* w, int len, float* regs)
{
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int ch = 0; ch < CH; ++ch) {
        const int c0 = lane * 8 + ch * 256;
        if (c0 < len) {
            load8_w<WT, VEC>(w, c0, len, regs + ch * 8);
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) regs[ch * 8 + e] = 0.0f;
        }
    }
}

// One row's choice by one warp (every lane returns it): greedy, the first largest key;
// sampled, the integer-mass draw with `bits`. Writes the row's q [K].
__device__ __forceinline__ int choose(const float* s, bool sampled, float inv_t, unsigned long long bits,
                                      unsigned long long* mass_s, float* qr)
{
    const int wl = threadIdx.x & 31;
    int best = 0;
    if (!sampled) {
        unsigned int bk = 0u;
        int bi = 0x7fffffff;
        for (int c = wl; c < K; c += 32) {
            const unsigned int kc = order_key(s[c]);
            if (key_wins(kc, c, bk, bi)) { bk = kc; bi = c; }
        }
        warp_key_argmax(bk, bi);
        best = bi;
        for (int c = wl; c < K; c += 32) qr[c] = c == best ? 1.0f : 0.0f;
        return best;
    }
    unsigned int kmax = 0u;
    for (int c = wl; c < K; c += 32) kmax = max(kmax, order_key(s[c] * inv_t));
#pragma unroll
    for (int o = 16; o; o >>= 1) kmax = max(kmax, __shfl_xor_sync(0xffffffffu, kmax, o));
    const float m = key_value(kmax);
    unsigned long long part = 0ull;
    for (int c = wl; c < K; c += 32) {
        mass_s[c] = draw_mass(s[c] * inv_t, m);
        part += mass_s[c];
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);  // exact: integers
    const unsigned long long total = part;
    __syncwarp();
    if (wl == 0 && total) {
        const unsigned long long target = draw_target(bits, total);
        unsigned long long run = 0ull;
        best = K - 1;
        for (int c = 0; c < K; ++c) {
            run += mass_s[c];
            if (run > target) { best = c; break; }
        }
    }
    best = __shfl_sync(0xffffffffu, best, 0);
    for (int c = wl; c < K; c += 32) qr[c] = total ? (float)mass_s[c] / (float)total : 0.0f;
    return best;
}

// How many of a best-first list's K words (descending; empty slots, 0, last) are above w: a
// binary search, log2 K + 1 shared reads (the merge's ranks: unique real words, so the counts
// over its lists are each element's rank)
__device__ __forceinline__ int count_above(const unsigned long long* a, unsigned long long w)
{
    int pos = 0;
#pragma unroll
    for (int step = K_POW2; step; step >>= 1)
        if (pos + step <= K && a[pos + step - 1] > w) pos += step;
    return pos;
}

// merge_row and walk_lane are static: the __shared__ arrays declared in them must be
// each module's own (the emulator loads every size variant as a library, where an inline
// function's block-scope statics would be one GNU_UNIQUE symbol sized by the first one loaded).
//
// selector_topk_merge's row g = lane * R + j (every thread of the block calls it).
static __device__ __forceinline__ void merge_row(const unsigned int* part, int nblk, int prow0, int prow_stride, int g,
                                                 int* ids, float* vals)
{
    __shared__ int pick[K];
    const int lane = g / RA, j = g - lane * RA;
    const uint2* p2 = reinterpret_cast<const uint2*>(part + ((long long)lane * prow_stride + prow0 + j) * nblk * K * 2);
    // an empty slot (any key, id 0xffffffff) ranks as 0: below every real pair
    auto word = [&](uint2 v) -> unsigned long long {
        return v.y >= (unsigned int)V ? 0ull : ((unsigned long long)v.x << 32) | (0xffffffffu - v.y);
    };
    // Phase 1: the K lists with the largest heads. Each list is best first, so an element of
    // any other list is below its own head, itself below K heads: the row's K best all lie in
    // these K lists (their set is all phase 2 needs). Every head load is issued before any is
    // used (nblk <= NBLK_MAX). Each warp finds its K best heads (K warp-wide rounds, no block
    // barrier); each of the TK_NW * K finalists is then ranked by the finalists above it (a
    // binary search in each warp's list, best first).
    unsigned long long head[MH];
#pragma unroll
    for (int m = 0; m < MH; ++m) {
        const int b = threadIdx.x + m * TK_NT;
        head[m] = b < nblk ? word(p2[(long long)b * K]) : 0ull;
    }
    __shared__ unsigned long long fin_w[TK_NW * K];
    __shared__ int fin_b[TK_NW * K];
    const int warp = threadIdx.x >> 5, wl = threadIdx.x & 31;
    unsigned long long last = ALL;
    for (int t = 0; t < K; ++t) {
        unsigned long long w = 0ull;
#pragma unroll
        for (int m = 0; m < MH; ++m)
            if (head[m] < last && head[m] > w) w = head[m];
#pragma unroll
        for (int o = 16; o; o >>= 1) {
            const unsigned long long x = __shfl_xor_sync(0xffffffffu, w, o);
            w = x > w ? x : w;
        }
        // real words are unique (one id each): one owner records its list
#pragma unroll
        for (int m = 0; m < MH; ++m)
            if (w && head[m] == w) fin_b[warp * K + t] = threadIdx.x + m * TK_NT;
        if (wl == 0) fin_w[warp * K + t] = w;
        last = w;
    }
    if ((int)threadIdx.x < K) pick[threadIdx.x] = -1;   // (fewer than K real heads: empty lists)
    __syncthreads();
    for (int f = threadIdx.x; f < TK_NW * K; f += TK_NT) {
        const unsigned long long w = fin_w[f];
        int r = 0;   // the finalists above w: per warp's list (best first, its rounds' order)
#pragma unroll
        for (int l = 0; l < TK_NW; ++l) r += count_above(fin_w + l * K, w);
        if (w && r < K) pick[r] = fin_b[f];
    }
    __syncthreads();
    // Phase 2: the K best of those lists' K * K pairs, all loads in flight at once, each ranked
    // by the pairs above it (real words are unique: the ranks of the nz real pairs are 0..nz-1,
    // the order K rounds of block_next_below would give): per list in shared memory, best first
    // (as every block wrote its own, empty slots last), a binary search for how many of its
    // pairs are above (log2 K + 1 reads a list, where comparing against every pair took K * K).
    __shared__ unsigned long long pw[K * K];
    unsigned long long held[MQ];
    int nz = 0;
#pragma unroll
    for (int m = 0; m < MQ; ++m) {
        const int i = threadIdx.x + m * TK_NT, l = i / K;
        const int b = i < K * K ? pick[l] : -1;
        held[m] = b >= 0 ? word(p2[(long long)b * K + (i - l * K)]) : 0ull;
        if (i < K * K) pw[i] = held[m];
        nz += __syncthreads_count(held[m] != 0ull);   // (also the barrier before pw is read)
    }
    int rank[MQ];
#pragma unroll
    for (int m = 0; m < MQ; ++m) {
        rank[m] = 0;
        for (int l = 0; l < K; ++l) rank[m] += count_above(pw + l * K, held[m]);
    }
    auto put = [&](int t, unsigned long long w) {
        // K <= V real pairs exist when every block wrote its K best; an empty slot (a
        // malformed partial buffer) becomes id 0 with a NaN value
        const unsigned int key = (unsigned int)(w >> 32);
        const int id = w ? (int)(0xffffffffu - (unsigned int)w) : 0;
        float v = (w ? key_value(key) : __uint_as_float(0x7fc00000u)) * MULT;
        if (CAP > 0.0f) v = tanhf(v / CAP_DIV) * CAP;
        ids[(long long)g * K + t] = id;
        vals[(long long)g * K + t] = v;
    };
#pragma unroll
    for (int m = 0; m < MQ; ++m)
        if (held[m] && rank[m] < K) put(rank[m], held[m]);
    if ((int)threadIdx.x < K && (int)threadIdx.x >= nz) put(threadIdx.x, 0ull);
}

// The walk's phase 1 slice s of lane `lane` (R > 0): warp w's hidden_projection row
// k = s * WK_NW + w against the lane's rows 1..Q-1, into hp_ws.
__device__ __forceinline__ void hp_slice(const float* hidden, int hidden_rows, const void* hp_w, int lane, int s,
                                         float* hp_ws)
{
    const int k = s * WK_NW + (threadIdx.x >> 5);
    if (k >= RANK) return;
    float acc[RA];
    warp_dot<SEL_HPT, RA, VEC_H>((const char*)hp_w + (long long)k * H * (SEL_HPT ? 2 : 4), H,
                                 hidden + ((long long)lane * hidden_rows + 1) * H, H, acc);
    if ((threadIdx.x & 31) == 0)
        for (int j = 0; j < R; ++j) hp_ws[((long long)lane * R + j) * RANK + k] = acc[j];
}

// Edge scores of lane `lane`'s row j (R > 0), one block: edges[lane][j][i][c] = vals[j][c] +
// warp_dot(succ_cb[ids[j][c]], u_i), u_i[k] = cb(pred_cb[p_i][k]) * hp[j][k] (f32), for every
// predecessor p_i the walk may hold before row j: the anchor (j = 0, i = 0 only) or row j - 1's
// candidate i; ESPLIT blocks a row, each EPB of the predecessors. Warp w scores its
// candidates c = w + m * WK_NW (successor rows in registers,
// SREG) against every u_i staged in shared memory: after the ids, one round trip for all the
// codebook rows, then no global load. Ids are clamped into [0, V) as the walk clamps them.
static __device__ __forceinline__ void edges_row(int lane, int j, int part, const void* pred_cb, const void* succ_cb,
                                                 const int* anchors, const int* ids, const float* vals,
                                                 const float* hp_ws, float* edges)
{
    __shared__ __align__(16) float u_s[UI * RANK];   // read as float4 where VEC_RANK
    __shared__ int cand_s[K], pred_s[K];
    __shared__ float val_s[K];
    const int warp = threadIdx.x >> 5, wl = threadIdx.x & 31;
    const long long rj = (long long)lane * R + j;
    auto clamp_id = [](int id) { return id < 0 ? 0 : (id >= V ? V - 1 : id); };
    for (int i = threadIdx.x; i < K; i += WK_NT) {
        cand_s[i] = clamp_id(ids[rj * K + i]);
        val_s[i] = vals[rj * K + i];
        pred_s[i] = clamp_id(j == 0 ? anchors[lane] : ids[(rj - 1) * K + i]);
    }
    __syncthreads();
    // this block's predecessors [p0, np): its part of the row's (row 0: the anchor, part 0's)
    const int p0 = part * EPB, np = j == 0 ? (part == 0 ? 1 : 0) : min(K, p0 + EPB);
    float sreg[SREG ? CPW : 1][SREG ? SCH * 8 : 8];
    if (SREG) {
#pragma unroll
        for (int m = 0; m < (SREG ? CPW : 1); ++m) {
            const int c = warp + m * WK_NW;
            if (c < K) warp_load<SEL_CBT, SREG ? SCH : 1, VEC_RANK>(cb_row(succ_cb, cand_s[c]), RANK, sreg[m]);
        }
    }
    const float* hp = hp_ws + rj * RANK;
    for (int i0 = p0; i0 < np; i0 += UI) {
        // u of predecessors i0 .. i0 + UI: every load of a thread issued before any product
        for (int k = threadIdx.x; k < RANK; k += WK_NT) {
            const float h = hp[k];
            float pv[UI];
#pragma unroll
            for (int e = 0; e < UI; ++e)
                pv[e] = i0 + e < np ? load_w<SEL_CBT>(pred_cb, (long long)pred_s[i0 + e] * RANK + k) : 0.0f;
#pragma unroll
            for (int e = 0; e < UI; ++e) u_s[e * RANK + k] = __fmul_rn(pv[e], h);
        }
        __syncthreads();
        for (int e = 0; e < UI && i0 + e < np; ++e) {
            const float* u = u_s + e * RANK;
            float acc[CPW];
#pragma unroll
            for (int m = 0; m < CPW; ++m) {
                acc[m] = 0.0f;
                const int c = warp + m * WK_NW;
                if (c >= K) continue;
                if (SREG) {   // warp_dot's order: lane chunks lane * 8 + ch * 256, elements ascending
#pragma unroll
                    for (int ch = 0; ch < (SREG ? SCH : 1); ++ch) {
                        const int c0 = wl * 8 + ch * 256;
                        if (c0 >= RANK) break;
                        float xe[8];
                        load8_w<0, VEC_RANK>(u, c0, RANK, xe);
#pragma unroll
                        for (int x = 0; x < 8; ++x)
                            if (c0 + x < RANK) acc[m] = __fadd_rn(acc[m], __fmul_rn(sreg[SREG ? m : 0][ch * 8 + x], xe[x]));
                    }
                } else {   // rows too many to hold: each from L2 (the same order and bits)
                    float d[1];
                    warp_dot<SEL_CBT, 1, VEC_RANK>(cb_row(succ_cb, cand_s[c]), RANK, u, 0, d);
                    acc[m] = d[0];
                }
            }
            if (SREG) warp_sum_n<CPW>(acc);
            if (wl == 0) {
#pragma unroll
                for (int m = 0; m < CPW; ++m) {
                    const int c = warp + m * WK_NW;
                    if (c < K) edges[(rj * K + i0 + e) * K + c] = __fadd_rn(val_s[c], acc[m]);
                }
            }
        }
        __syncthreads();   // u_s is rewritten for the next predecessors
    }
}

// The walk of lane `lane` by one block, once every row's edges have arrived (read through L2:
// other SMs wrote them in this launch, arrive.cuh). Row j's scores are the edges of the
// predecessor chosen before it, so a row's choice is its only dependence on the row before:
// warp 0 walks, every row's scores staged in shared memory first where they fit (ESTAGE).
static __device__ __forceinline__ void walk_lane(int lane, const int* anchors, const int* ids, const float* knobs,
                                                 const unsigned long long* rng, int per_lane, int* tokens,
                                                 int* choice, float* q, const float* edges, int* counters, int* flags)
{
    __shared__ float e_s[ESTAGE ? RA * K * K : 1];
    __shared__ float s_s[K];
    __shared__ int ids_s[RA * K];
    __shared__ unsigned long long bits_s[RA], mass_s[K];
    const int warp = threadIdx.x >> 5, wl = threadIdx.x & 31;
    const float temperature = knobs[per_lane ? 3 * lane : 0];
    const bool sampled = temperature > 0.0f;
    const float* el = edges + (long long)lane * R * K * K;
    // every load of a thread in flight at once, then the stores (unpredicated where the items
    // fill whole rounds of threads: ptxas batches predicated loads by its 7 predicates)
    constexpr bool WHOLE = (R * K * K) % WK_NT == 0;
    constexpr int IDT = (RA * K + WK_NT - 1) / WK_NT;
    float ev[ESTAGE ? EST : 1];
    int iv[IDT];
    if (ESTAGE) {
#pragma unroll
        for (int t = 0; t < EST; ++t) {
            const int i = threadIdx.x + t * WK_NT;
            ev[t] = WHOLE || i < R * K * K ? __ldcg(el + i) : 0.0f;
        }
    }
#pragma unroll
    for (int t = 0; t < IDT; ++t) {
        const int i = threadIdx.x + t * WK_NT;
        iv[t] = i < R * K ? ids[(long long)lane * R * K + i] : 0;
    }
    const int a_in = threadIdx.x == 0 ? anchors[lane] : 0;
    if (ESTAGE) {
#pragma unroll
        for (int t = 0; t < EST; ++t) {
            const int i = threadIdx.x + t * WK_NT;
            if (WHOLE || i < R * K * K) e_s[i] = ev[t];
        }
    }
#pragma unroll
    for (int t = 0; t < IDT; ++t) {
        const int i = threadIdx.x + t * WK_NT;
        if (i < R * K) ids_s[i] = iv[t];
    }
    if (sampled) {
        // per_lane: the lane draws as a single lane (lanes = 1) with its own seed and counter base would
        const unsigned long long* sb = per_lane ? rng + 2 * lane : rng;
        const int row0 = per_lane ? 1 : lane * Q + 1;
        for (int j = threadIdx.x; j < R; j += WK_NT) bits_s[j] = row_bits64((unsigned int)(row0 + j), sb);
    }
    if (threadIdx.x == 0) {
        int a = a_in;
        const bool bad = a < 0 || a >= V;
        a = a < 0 ? 0 : (a >= V ? V - 1 : a);
        flags[lane] = bad ? 1 : 0;
        tokens[(long long)lane * Q] = a;
        if (R > 0) counters[lane] = 0;  // every block of this lane has arrived: ready for the next launch
    }
    __syncthreads();
    if (warp != 0) return;
    const float inv_t = sampled ? 1.0f / temperature : 1.0f;
    int prev = 0;   // the predecessor's candidate index (row 0: the anchor's one row)
    for (int j = 0; j < R; ++j) {
        const long long rj = (long long)lane * R + j;
        const float* s = s_s;
        if (ESTAGE) {
            s = e_s + (j * K + prev) * K;
        } else {   // scores too many to stage: the chosen row's, a dependent L2 round trip
            for (int c = wl; c < K; c += 32) s_s[c] = __ldcg(el + (j * K + prev) * K + c);
            __syncwarp();
        }
        const int best = choose(s, sampled, inv_t, sampled ? bits_s[j] : 0ull, mass_s, q + rj * K);
        if (wl == 0) {
            choice[rj] = best;
            const int id = ids_s[j * K + best];
            tokens[(long long)lane * Q + j + 1] = id < 0 ? 0 : (id >= V ? V - 1 : id);
        }
        prev = best;
        __syncwarp();   // s_s and mass_s are rewritten for the next row
    }
}
}  // namespace selector_detail

extern "C" __global__ void __launch_bounds__(SEL_TK_NT)
selector_topk_blocks(const float* logits, int ld, int row0, int row_stride, int nblk, unsigned int* part)
{
    pdl_wait();  // pdl.cuh: everything below may read what the kernel before wrote
    pdl_launch_dependents();
    using namespace selector_detail;
    __shared__ unsigned long long red[TK_NW];
    const int g = blockIdx.y, b = blockIdx.x;
    const int lane = g / (R > 0 ? R : 1), j = g - lane * (R > 0 ? R : 1);
    const float* row = logits + (long long)(lane * row_stride + row0 + j) * ld;
    unsigned long long w[TK_PER];
#pragma unroll
    for (int i = 0; i < TK_PER; ++i) {
        const int col = b * TK_TILE + i * TK_NT + threadIdx.x;
        w[i] = col < V ? rank_word(row[col], (unsigned int)col) : 0ull;
    }
    unsigned int* out = part + ((long long)g * nblk + b) * K * 2;
    unsigned long long last = ALL;  // each round takes the largest word below the previous winner
    for (int t = 0; t < K; ++t) {
        last = block_next_below<TK_PER>(w, last, red);
        if (threadIdx.x == 0) {
            out[2 * t] = (unsigned int)(last >> 32);
            out[2 * t + 1] = last ? 0xffffffffu - (unsigned int)last : 0xffffffffu;
        }
    }
}

extern "C" __global__ void __launch_bounds__(SEL_TK_NT)
selector_topk_merge(const unsigned int* part, int nblk, int prow0, int prow_stride, int* ids, float* vals)
{
    pdl_wait();
    pdl_launch_dependents();
    selector_detail::merge_row(part, nblk, prow0, prow_stride, blockIdx.x, ids, vals);
}

// (min 1 block per SM: without it ptxas targets 64 registers and spills the hidden
// projection's N accumulators; the grid is small, ILP is what hides the loads)
extern "C" __global__ void __launch_bounds__(SEL_WK_NW * 32, 1)
selector_project_merge(const unsigned int* part, int nblk, int prow0, int prow_stride, int merge_rows,
                       const float* hidden, int hidden_rows, const void* hp_w, int* ids, float* vals, float* hp_ws)
{
    pdl_wait();
    pdl_launch_dependents();
    using namespace selector_detail;
    static_assert(TK_NT == WK_NT, "selector_project_merge: the merge and the projection share the block size");
    const int lane = blockIdx.y, split = (int)gridDim.x - merge_rows;
    if ((int)blockIdx.x < split) hp_slice(hidden, hidden_rows, hp_w, lane, blockIdx.x, hp_ws);
    else merge_row(part, nblk, prow0, prow_stride, lane * R + blockIdx.x - split, ids, vals);
}

extern "C" __global__ void __launch_bounds__(SEL_WK_NW * 32, 1)
selector_edges_walk(const void* pred_cb, const void* succ_cb, const int* anchors, const int* ids, const float* vals,
                    const float* knobs, const unsigned long long* rng, int per_lane, int* tokens, int* choice,
                    float* q, const float* hp_ws, float* edges, int* counters, int* flags)
{
    pdl_wait();
    pdl_launch_dependents();
    using namespace selector_detail;
    __shared__ int ticket;
    const int lane = blockIdx.y;
    if (R > 0) {
        edges_row(lane, blockIdx.x / ESPLIT, blockIdx.x % ESPLIT, pred_cb, succ_cb, anchors, ids, vals, hp_ws, edges);
        if (!last_block_to_arrive(&counters[lane], gridDim.x, &ticket)) return;
    }
    walk_lane(lane, anchors, ids, knobs, rng, per_lane, tokens, choice, q, edges, counters, flags);
}
