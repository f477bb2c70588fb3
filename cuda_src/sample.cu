// sample.cu — draft tokens from rows of logits: greedy argmax, or seeded
// sampling with temperature, top-k and top-p from a counter-based RNG.
//
// Layouts: logits [n_rows, ld] f32 (the first SAMPLE_V columns are the vocabulary),
// tokens [n_rows] int32 (out). Per-step values live in device memory so a captured
// graph picks up new ones at every replay:
//   knobs f32 [3]: temperature (0: greedy), top_p (>= 1: off), top_k (0 or >= V: off;
//                  an integer held exactly in f32);
//   rng   u64 [2]: seed, counter base (e.g. the step's first noise position).
//   lane_rows > 0: rows are lanes' blocks of lane_rows rows; row = lane * lane_rows + r reads
//   knobs [lane][3] and rng [lane][2] and draws as row r (each lane as a one-lane call).
// Launch: grid = n_rows (one block per row), block = SAMPLE_BLOCK. No dynamic shared memory.
//
// What it computes (ops/sample.py's NumPy reference mirrors every step):
//  greedy: the lowest index of the largest logit (NaN ranks below -inf, as in key order).
//  sampling, per row:
//   z_i = logit_i * (1/T) (both in f32); key_i = the order-preserving u32 of z_i (NaN -> 0);
//   m = max z; w_i = 1 if z_i == m else expf(z_i - m); mass_i = trunc(w_i * 2^40) (u64).
//     Integer masses make every sum below exact and independent of summation order, so the
//     kernel is deterministic; a token whose probability is under 2^-40 of the most likely
//     one is never drawn.
//   top-k: keep key_i >= kth, the k-th largest key (ties at the threshold are all kept).
//   top-p: among those, S = kept mass, P = ceil(top_p * S) (in double); keep key_i >= t,
//     t the largest key with mass(kept, key >= t) >= P (the smallest prefix of the
//     descending order that holds top_p of the mass; ties kept).
//   draw (draw.cuh): (c0..c3) = Philox4x32-10(counter = (row, base lo, base hi, 0), key = seed);
//     r = c1 << 32 | c0; target = floor(r * S_kept / 2^64); token = the first index (in id order)
//     whose running kept mass exceeds target.
//  Thresholds come from radix selection over the keys (4 passes of 8 bits, histograms in
//  shared memory with integer atomics); the draw scans contiguous chunks after a block-wide
//  exclusive scan of their masses.
//
// nvrtc-check: -DSAMPLE_V=151936 -DSAMPLE_BLOCK=512
// nvrtc-check: -DSAMPLE_V=19 -DSAMPLE_BLOCK=64

#ifndef SAMPLE_V
#define SAMPLE_V 1000
#endif
#ifndef SAMPLE_BLOCK
#define SAMPLE_BLOCK 256
#endif

#if SAMPLE_BLOCK % 32 != 0 || SAMPLE_BLOCK > 1024
#error "SAMPLE_BLOCK must be a multiple of 32, at most 1024"
#endif

#include "draw.cuh"
#include "float_order.cuh"
#include "pdl.cuh"

namespace sample_detail {
constexpr int V = SAMPLE_V;
constexpr int NT = SAMPLE_BLOCK;
constexpr int NW = NT / 32;
constexpr int CHUNK = (V + NT - 1) / NT;  // contiguous columns per thread in the draw
// Every thread gets the block's sum (warp partials added in a fixed order).
__device__ __forceinline__ unsigned long long block_sum(unsigned long long v, unsigned long long* red)
{
#pragma unroll
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();  // red may still be read from the previous call
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    unsigned long long t = 0;
    for (int i = 0; i < NW; ++i) t += red[i];
    return t;
}

__device__ __forceinline__ unsigned int block_max(unsigned int v, unsigned int* red)
{
#pragma unroll
    for (int o = 16; o; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    unsigned int t = 0;
    for (int i = 0; i < NW; ++i) t = max(t, red[i]);
    return t;
}

struct SampleShared {
    unsigned long long hist[256];
    unsigned long long red[NW];
    unsigned int redk[NW];
    unsigned int prefix;
    unsigned long long carry;
};

// Radix selection of a threshold key among the row's keys with key >= floor_key:
// by_mass == false: the largest key t with count(key >= t) >= need (the need-th largest);
// by_mass == true:  the largest key t with mass(key >= t) >= need.
__device__ unsigned int radix_select(const float* zrow, float inv_t, float m, unsigned int floor_key,
                                     bool by_mass, unsigned long long need, SampleShared& sh)
{
    unsigned int prefix = 0u, pmask = 0u;
    unsigned long long above = 0ull;  // count or mass of selected keys above the current bin range
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += NT) sh.hist[b] = 0ull;
        __syncthreads();
        for (int i = threadIdx.x; i < V; i += NT) {
            const float z = zrow[i] * inv_t;
            const unsigned int k = order_key(z);
            if (k >= floor_key && (k & pmask) == prefix) {
                const unsigned long long add = by_mass ? draw_mass(z, m) : 1ull;
                if (add) atomicAdd(&sh.hist[(k >> shift) & 255u], add);
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned long long acc = above;
            int b = 255;
            for (; b > 0; --b) {
                if (acc + sh.hist[b] >= need) break;
                acc += sh.hist[b];
            }
            sh.prefix = prefix | ((unsigned int)b << shift);
            sh.carry = acc;
        }
        __syncthreads();
        prefix = sh.prefix;
        above = sh.carry;
        pmask |= 255u << shift;
        __syncthreads();
    }
    return prefix;
}
}  // namespace sample_detail

extern "C" __global__ void __launch_bounds__(SAMPLE_BLOCK)
sample_rows(const float* logits, int ld, int n_rows, const float* knobs, const unsigned long long* rng,
            int lane_rows, int* tokens)
{
    pdl_wait();  // pdl.cuh: everything below may read what the kernel before wrote
    pdl_launch_dependents();
    using namespace sample_detail;
    __shared__ SampleShared sh;
    const int row = blockIdx.x;
    if (row >= n_rows) return;
    const float* lrow = logits + (long long)row * ld;
    const float* kn = lane_rows > 0 ? knobs + 3 * (row / lane_rows) : knobs;
    const float temperature = kn[0], top_p = kn[1], top_k_f = kn[2];

    if (!(temperature > 0.0f)) {  // greedy: largest key, lowest index among equals
        unsigned int best = 0u;
        int best_i = 0x7fffffff;
        for (int i = threadIdx.x; i < V; i += NT) {
            const unsigned int k = order_key(lrow[i]);
            if (k > best || best_i == 0x7fffffff) { best = k; best_i = i; }
        }
        warp_key_argmax(best, best_i);
        if ((threadIdx.x & 31) == 0) { sh.redk[threadIdx.x >> 5] = best; sh.hist[threadIdx.x >> 5] = (unsigned long long)best_i; }
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned int bk = sh.redk[0];
            int bi = (int)sh.hist[0];
            for (int w = 1; w < NW; ++w) {
                const unsigned int k = sh.redk[w];
                const int i = (int)sh.hist[w];
                if (key_wins(k, i, bk, bi)) { bk = k; bi = i; }
            }
            tokens[row] = bi < V ? bi : 0;
        }
        return;
    }

    const float inv_t = 1.0f / temperature;
    unsigned int kmax = 0u;
    for (int i = threadIdx.x; i < V; i += NT) kmax = max(kmax, order_key(lrow[i] * inv_t));
    kmax = block_max(kmax, sh.redk);
    const float m = key_value(kmax);

    unsigned int thr = 1u;  // NaN keys (0) never drawn
    const int top_k = (int)top_k_f;
    if (top_k > 0 && top_k < V)
        thr = max(thr, radix_select(lrow, inv_t, m, 0u, false, (unsigned long long)top_k, sh));
    if (top_p < 1.0f) {
        unsigned long long s = 0ull;
        for (int i = threadIdx.x; i < V; i += NT) {
            const float z = lrow[i] * inv_t;
            if (order_key(z) >= thr) s += draw_mass(z, m);
        }
        s = block_sum(s, sh.red);
        if (s > 0ull) {
            unsigned long long p = (unsigned long long)ceil((double)top_p * (double)s);
            p = p < 1ull ? 1ull : (p > s ? s : p);
            thr = max(thr, radix_select(lrow, inv_t, m, thr, true, p, sh));
        }
    }

    // The draw: each thread owns a contiguous chunk; an exclusive scan of chunk masses
    // (warp shuffles, then warp totals in a fixed order) finds the chunk holding target.
    const int c0 = threadIdx.x * CHUNK, c1 = min(V, c0 + CHUNK);
    unsigned long long mine = 0ull;
    for (int i = c0; i < c1; ++i) {
        const float z = lrow[i] * inv_t;
        if (order_key(z) >= thr) mine += draw_mass(z, m);
    }
    unsigned long long incl = mine;
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long up = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += up;
    }
    __syncthreads();
    if (lane == 31) sh.red[wid] = incl;
    __syncthreads();
    unsigned long long before = 0ull, total = 0ull;
    for (int w = 0; w < NW; ++w) {
        if (w < wid) before += sh.red[w];
        total += sh.red[w];
    }
    const unsigned long long start = before + incl - mine;
    if (threadIdx.x == 0 && total == 0ull) tokens[row] = 0;  // nothing drawable (all NaN)
    if (total == 0ull || mine == 0ull) return;

    // the lane (rl) and the row within it, derived here: nothing held live through the selection
    const int rl = lane_rows > 0 ? row / lane_rows : 0;
    const unsigned long long target =
        draw_target(row_bits64((unsigned int)(row - rl * lane_rows), rng + 2 * rl), total);
    if (target < start || target >= start + mine) return;
    unsigned long long run = start;
    for (int i = c0; i < c1; ++i) {
        const float z = lrow[i] * inv_t;
        if (order_key(z) < thr) continue;
        run += draw_mass(z, m);
        if (run > target) { tokens[row] = i; return; }
    }
}

// The greedy token of each row from the fused lm_head GEMM's partials
// (gemm_stream.cu with GS_EPI 3): part [n_rows][nblk][2] u32 = (order key, column)
// of each column block's best. Launch: grid = n_rows, block = SAMPLE_BLOCK.
extern "C" __global__ void __launch_bounds__(SAMPLE_BLOCK)
argmax_partials(const unsigned int* part, int nblk, int n_rows, int* tokens)
{
    pdl_wait();  // pdl.cuh: everything below may read what the kernel before wrote
    pdl_launch_dependents();
    using namespace sample_detail;
    __shared__ unsigned int wk[NW];
    __shared__ int wi[NW];
    const int row = blockIdx.x;
    if (row >= n_rows) return;
    const unsigned int* p = part + (long long)row * nblk * 2;
    unsigned int best = 0u;
    int best_i = 0x7fffffff;
    for (int b = threadIdx.x; b < nblk; b += NT) {
        const unsigned int k = p[2 * b];
        const int i = (int)p[2 * b + 1];
        if (key_wins(k, i, best, best_i)) { best = k; best_i = i; }
    }
    warp_key_argmax(best, best_i);
    if ((threadIdx.x & 31) == 0) { wk[threadIdx.x >> 5] = best; wi[threadIdx.x >> 5] = best_i; }
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int bk = wk[0];
        int bi = wi[0];
        for (int w = 1; w < NW; ++w)
            if (key_wins(wk[w], wi[w], bk, bi)) { bk = wk[w]; bi = wi[w]; }
        tokens[row] = bi == 0x7fffffff ? 0 : bi;
    }
}
