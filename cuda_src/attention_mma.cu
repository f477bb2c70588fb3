// attention_mma.cu — the split-KV ring attention of attention.cu on tensor cores.
//
// Same inputs, outputs, partial layout, masks, GQA and gate as
// ring_attn_split (attention.cu; counters here [LANES * NKV]), and the same
// two merges of the splits (attention_common.cuh, which also has the sizes:
// FOLD_MERGE 0 leaves it to attention.cu's ring_attn_combine). Needs
// D % 16 == 0, D <= 128 and at most 128 query rows per kv head
// (R = B * NH/NKV): 8 warps (at 16, ptxas caps a thread at 128 registers and
// the kernel spills).
//
// ring_attn_mma_split: grid (NKV, SPLITS, LANES), block (MW*32), MW = ceil(R / 16).
//   A block takes one kv head and one contiguous slice of keys; warp w owns
//   query rows 16w .. 16w+15 of that head (row r = b*G + g_head), so every
//   K/V tile in shared memory serves all R rows. Per 32-key tile, as
//   FlashAttention-2 does it with mma.sync m16n8k16 (f16 in, f32 out):
//     S = Q K^T   Q from registers, K tile [key][d] in shared memory is the
//                 "col" B operand as it stands;
//     online softmax on the S fragments in the log2 domain (q pre-scaled by
//                 scale*log2(e)), row max/sum over the 4 lanes of a row;
//     O += P V    the S fragments of two 8-key groups are the A fragment of
//                 P for one 16-key step; V is staged as it stands ([key][d],
//                 16-byte rows like K) and its B fragments are read with
//                 ldmatrix.trans (ldmatrix.cuh): no transposing stores, no
//                 bank conflicts.
//   SPLITS == 1: the block normalises and writes `out`. SPLITS > 1: it writes
//   its partial; with FOLD_MERGE 1 the last of the SPLITS blocks of its
//   (lane, kv head), counters[blockIdx.z * NKV + blockIdx.x], merges the
//   splits of all R rows into `out` (attention_common.cuh: the folded
//   combine); with FOLD_MERGE 0 ring_attn_combine does, in a second launch.
// Isolation (as attention.cu): a slot hidden from a query row never reaches that
//   row's output, whatever it holds; the tile loop below says how, and how a
//   tile's loads are pipelined.
//   Q and P are f32 split into two f16 terms (hi + lo, ~22 significant bits
//   for P in [0,1], ~16 for q) so the products keep f32-like accuracy; K and V
//   are the f16 cache rows themselves.
//
// nvrtc-check: -DD=64 -DNH=8 -DNKV=2 -DB=16 -DKV_TOTAL=100 -DSPLITS=3 -DGATE=2
// nvrtc-check: -DD=32 -DNH=4 -DNKV=4 -DB=1 -DKV_TOTAL=37 -DSPLITS=1 -DGATE=1
// nvrtc-check: -DD=128 -DNH=64 -DNKV=8 -DB=16 -DKV_TOTAL=4128 -DSPLITS=8 -DGATE=1
// nvrtc-check: -DD=128 -DNH=8 -DNKV=8 -DB=128 -DKV_TOTAL=2080 -DSPLITS=4 -DGATE=0
// nvrtc-check: -DD=128 -DNH=64 -DNKV=8 -DB=16 -DKV_TOTAL=4128 -DSPLITS=8 -DGATE=1 -DOUT16=2
// nvrtc-check: -DD=32 -DNH=4 -DNKV=4 -DB=1 -DKV_TOTAL=37 -DSPLITS=1 -DGATE=1 -DOUT16=1
// nvrtc-check: -DD=64 -DNH=8 -DNKV=2 -DB=16 -DKV_TOTAL=100 -DSPLITS=3 -DGATE=2 -DFOLD_MERGE=0
// nvrtc-check: -DD=128 -DNH=32 -DNKV=8 -DB=16 -DKV_TOTAL=2080 -DSPLITS=4 -DGATE=2 -DLANES=64 -DLANE_ROWS=16 -DPAGE=128
#include <cuda_fp16.h>
#include "attention_common.cuh"
#include "mma.cuh"
#include "ldmatrix.cuh"
#include "pdl.cuh"

#define MW ((R + 15) / 16)          // warps: one per 16 query rows
#define THR (MW * 32)
#define KS (D + 8)                  // k_s / v_s row stride (halves): conflict-free fragment loads
#define DK (D / 16)                 // k steps of Q K^T
#define DN (D / 8)                  // n tiles of O
#define MS (TILE + 8)               // m_s row stride (halves): a warp's query rows on distinct banks

#if D % 16 != 0 || D > 128
#error "attention_mma.cu: D must be a multiple of 16 and at most 128"
#endif
#if MW > 8
#error "attention_mma.cu: at most 128 query rows per kv head"
#endif
#if TILE != 32
#error "attention_mma.cu: the key visibility word holds one bit per key of a 32-key tile"
#endif

namespace attn_mma {

__device__ __forceinline__ unsigned int h2bits(float lo, float hi) {
    return (unsigned int)__half_as_ushort(__float2half(lo)) |
           ((unsigned int)__half_as_ushort(__float2half(hi)) << 16);
}

// (a, b) -> f16 pair hi and the f16 pair of the rounding residue lo
__device__ __forceinline__ void split2(float a, float b, unsigned int& hi, unsigned int& lo) {
    const __half ha = __float2half(a), hb = __float2half(b);
    hi = (unsigned int)__half_as_ushort(ha) | ((unsigned int)__half_as_ushort(hb) << 16);
    lo = h2bits(a - __half2float(ha), b - __half2float(hb));
}

__device__ __forceinline__ unsigned int ld32(const __half* p) {
    return *reinterpret_cast<const unsigned int*>(p);
}

__device__ __forceinline__ bool half_nonfinite(unsigned short h) { return (h & 0x7c00u) == 0x7c00u; }

// The two f16 of w with any NaN/Inf replaced by +0; bad |= one was.
__device__ __forceinline__ unsigned int finite2(unsigned int w, bool& bad) {
    unsigned int m = 0u;
    if (half_nonfinite((unsigned short)(w & 0xffffu))) m |= 0xffffu;
    if (half_nonfinite((unsigned short)(w >> 16))) m |= 0xffff0000u;
    bad |= m != 0u;
    return w & ~m;
}

// Mask rows of this warp (w, w + MW, ...): MROWS per warp, a row past B reads nothing.
#define MROWS ((B + MW - 1) / MW)

// Issue the mask loads of keys k0 .. k0+31 (one 2-byte load per mask row and
// lane, all independent; -inf past k_end), consumed after the tile's math.
__device__ __forceinline__ void load_mask(const __half* __restrict__ mask, int k0, int k_end,
                                          unsigned short (&mk)[MROWS], int warp, int lane) {
    const int key = k0 + lane;
#pragma unroll
    for (int i = 0; i < MROWS; ++i) {
        const int b = warp + MW * i;
        mk[i] = (b < B && key < k_end) ? __half_as_ushort(mask[(long long)b * KV_TOTAL + key]) : (unsigned short)0xfc00u;
    }
}

// The keys of the tile that some query row sees: a ballot per mask row, this
// warp's OR into vis_w[warp] (read_visibility ORs the MW words).
__device__ __forceinline__ void publish_visibility(const unsigned short (&mk)[MROWS], unsigned int* vis_w,
                                                   int warp, int lane) {
    unsigned int v = 0u;
#pragma unroll
    for (int i = 0; i < MROWS; ++i)
        if (warp + MW * i < B)   // warp-uniform
            v |= __ballot_sync(0xffffffffu, mk[i] != 0xfc00u);
    if (lane == 0) vis_w[warp] = v;
}

// The mask rows kept in m_tile [B][MS] for the tile's scores: the mask is read
// from global memory once per key column, not once per query row.
__device__ __forceinline__ void store_mask(const unsigned short (&mk)[MROWS], __half* m_tile, int warp, int lane) {
#pragma unroll
    for (int i = 0; i < MROWS; ++i) {
        const int b = warp + MW * i;
        if (b < B) m_tile[b * MS + lane] = __ushort_as_half(mk[i]);
    }
}

// The OR of the MW words (16 / 8-byte shared loads where MW allows: one instruction per 4 / 2).
__device__ __forceinline__ unsigned int read_visibility(const unsigned int* vis_w) {
    unsigned int v = 0u;
#if MW % 4 == 0
#pragma unroll
    for (int w = 0; w < MW; w += 4) {
        const uint4 x = *reinterpret_cast<const uint4*>(vis_w + w);
        v |= x.x | x.y | x.z | x.w;
    }
#elif MW % 2 == 0
#pragma unroll
    for (int w = 0; w < MW; w += 2) {
        const uint2 x = *reinterpret_cast<const uint2*>(vis_w + w);
        v |= x.x | x.y;
    }
#else
#pragma unroll
    for (int w = 0; w < MW; ++w) v |= vis_w[w];
#endif
    return v;
}

// K/V staging: item i = threadIdx.x + THR * j is 16 bytes (8 dims from c) of
// key i / (D/8); a key hidden from every row (or past k_end) is not read:
// zeros. K goes to shared memory by asynchronous copies (no registers), V
// through registers (its non-finite entries are replaced on the way).
#define KV_ITEMS (TILE * (D / 8))
#define KV_PER ((KV_ITEMS + THR - 1) / THR)

// kr: the tile's first physical row (tile_row)
__device__ __forceinline__ void load_k_async(const __half* __restrict__ k_cache, int kr, unsigned int vis, int kvh,
                                             __half* k_tile) {
#pragma unroll
    for (int j = 0; j < KV_PER; ++j) {
        const int i = (int)threadIdx.x + THR * j, key = i / (D / 8), c = (i % (D / 8)) * 8;
        if (KV_ITEMS % THR == 0 || i < KV_ITEMS) {
            const bool seen = (vis >> key) & 1u;
            cp_async16(&k_tile[key * KS + c], seen ? k_cache + ((long long)(kr + key) * KV_W + kvh * D + c) : k_cache, seen);
        }
    }
    cp_async_commit();
}

__device__ __forceinline__ void load_v(const __half* __restrict__ v_cache, int kr, unsigned int vis, int kvh,
                                       uint4 (&vc)[KV_PER]) {
#pragma unroll
    for (int j = 0; j < KV_PER; ++j) {
        const int i = (int)threadIdx.x + THR * j, key = i / (D / 8), c = (i % (D / 8)) * 8;
        vc[j] = make_uint4(0u, 0u, 0u, 0u);
        if ((KV_ITEMS % THR == 0 || i < KV_ITEMS) && ((vis >> key) & 1u))
            // coherent (__ldcg): stays before the barrier it is issued before (ptxas may
            // sink a read-only .nc load past it, into the tile's math)
            vc[j] = __ldcg(reinterpret_cast<const uint4*>(v_cache + (long long)(kr + key) * KV_W + kvh * D + c));
    }
}

// V into v_s, its non-finite entries as 0 (bad |= one was).
__device__ __forceinline__ void store_v(const uint4 (&vc)[KV_PER], __half* v_s, bool& bad) {
#pragma unroll
    for (int j = 0; j < KV_PER; ++j) {
        const int i = (int)threadIdx.x + THR * j, key = i / (D / 8), c = (i % (D / 8)) * 8;
        if (KV_ITEMS % THR == 0 || i < KV_ITEMS) {
            uint4 v = vc[j];
            v.x = finite2(v.x, bad);
            v.y = finite2(v.y, bad);
            v.z = finite2(v.z, bad);
            v.w = finite2(v.w, bad);
            *reinterpret_cast<uint4*>(&v_s[key * KS + c]) = v;
        }
    }
}

}  // namespace attn_mma

extern "C" __global__ void __launch_bounds__(THR, 1)
ring_attn_mma_split(const float* __restrict__ q,
                    const __half* __restrict__ k_cache,
                    const __half* __restrict__ v_cache,
                    const int* __restrict__ pages,
                    const __half* __restrict__ mask,
                    float* __restrict__ part_o,
                    float* __restrict__ part_ml,
                    int* __restrict__ counters,
                    OUT_T* __restrict__ out,
                    const float* __restrict__ gate,
                    float scale,
                    const int* __restrict__ live,
                    int use_live)
{
    pdl_wait();  // pdl.cuh: everything below may read what the kernel before wrote
    pdl_launch_dependents();
    using namespace attn_mma;
    const int lane_id = LANES == 1 ? 0 : (int)blockIdx.z;   // the request (attention_common.cuh: lanes)
    if (lane_idle(live, use_live, lane_id)) return;
    {
        const LaneOffsets lo = lane_offsets(lane_id);
        q += lo.q_o;
        out += lo.q_o;
        gate += lo.gate;
        pages += lo.pages;
        mask += lo.mask;
        part_o += lo.part_o;
        part_ml += lo.part_ml;
    }
    __shared__ __align__(16) __half k_s[2][TILE * KS];    // per tile parity: the next one fills while this one is read
    __shared__ __align__(16) __half v_s[TILE * KS];
    __shared__ __align__(16) unsigned int vis_s[3][MW];   // slot tile % 3, per warp: bit j = key k0 + j seen by one of its rows
    __shared__ __align__(16) __half m_s[2][B * MS];       // per tile parity: the mask tile (B <= 128: <= 20 KB)

    const int kvh = blockIdx.x, split = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int k_begin = split * SPLIT_KEYS;
    const int k_end = min(KV_TOTAL, k_begin + SPLIT_KEYS);

    // The pipeline's start (file header): the masks of tiles 0 and 1 (loaded
    // with Q), then tile 0's K and V.
    unsigned short mk[MROWS], mk_next[MROWS];
    load_mask(mask, k_begin, k_end, mk, warp, lane);
    load_mask(mask, k_begin + TILE, k_end, mk_next, warp, lane);

    // This lane's two query rows (fragment rows g and g+8 of the warp's 16).
    int rowr[2], bq[2];
    bool rok[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        rowr[u] = warp * 16 + g + 8 * u;
        rok[u] = rowr[u] < R;
        bq[u] = rok[u] ? rowr[u] / G : 0;
    }

    // Q as A fragments, hi and lo, pre-scaled for exp2: for k step kk the
    // lane holds Q[row][16kk + 2t (+1)] and Q[row][16kk + 2t + 8 (+1)].
    unsigned int qh[DK][4], ql[DK][4];
    const float qscale = scale * LOG2E;
#pragma unroll
    for (int kk = 0; kk < DK; ++kk) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {           // e: (row g | g+8) x (cols +0 | +8)
            const int u = e & 1, d = 16 * kk + 2 * t + ((e & 2) ? 8 : 0);
            float a = 0.f, b2 = 0.f;
            if (rok[u]) {
                const int h = kvh * G + rowr[u] % G;
                // one 8-byte load per pair (d even, rows of D floats): two 4-byte ones
                // touched every sector twice
                const float2 qv = *reinterpret_cast<const float2*>(q + ((long long)bq[u] * NH + h) * D + d);
                a = qv.x * qscale;
                b2 = qv.y * qscale;
            }
            split2(a, b2, qh[kk][e], ql[kk][e]);
        }
    }

    float o[DN][4];
#pragma unroll
    for (int j = 0; j < DN; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[j][e] = 0.f;
    float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.f, 0.f};

    // ldmatrix row of this lane in the P V step: matrix lane/8 = (keys +0 | +8) x (dims +0 | +8)
    const int lm_key = (lane & 7) + ((lane & 8) ? 8 : 0), lm_dim = (lane & 16) ? 8 : 0;

    publish_visibility(mk, vis_s[0], warp, lane);
    store_mask(mk, m_s[0], warp, lane);
    publish_visibility(mk_next, vis_s[1], warp, lane);
    __syncthreads();
    uint4 vc[KV_PER];
    // First physical rows of the tiles (page table, one load per tile): the next tile's and
    // the one after (loaded a tile before its K/V loads need it, as the mask is, so no round
    // trip waits on it). A tile past the split's keys has no key any row sees: nothing is
    // read there.
    int row_next = 0, row_ahead = 0;
    {
        const unsigned int vis = read_visibility(vis_s[0]);
        const int row0 = k_begin < k_end ? tile_row(pages, k_begin) : 0;
        if (k_begin < k_end) load_k_async(k_cache, row0, vis, kvh, k_s[0]);
        load_v(v_cache, row0, vis, kvh, vc);
        if (k_begin + TILE < k_end) row_ahead = tile_row(pages, k_begin + TILE);
    }

    // Isolation: a slot hidden from a query row never reaches that row's output,
    // whatever it holds (NaN, +-Inf, 65504): its score is selected to -inf (a
    // hidden mask entry is never added), a key hidden from every row of the
    // launch is staged as zeros in K and V (a tensor core computes 0 x NaN =
    // NaN), and a non-finite V entry of a key some rows see is staged as 0 and
    // its exact contribution added only to the rows that see the key (rare: a
    // __syncthreads_or per tile says whether any such entry is present).
    // Visibility of a tile's keys (the OR over the q_len mask rows) is a ballot
    // per mask row. Pipeline (all loads of a tile issued together, a tile
    // ahead): before tile t computes, tile t+1's K (asynchronous copies into the
    // other k_s buffer) and V (16-byte loads into registers), for the keys some
    // row sees, and tile t+2's mask rows (registers) are issued; after tile t the
    // mask rows give tile t+2's visibility, at the top of tile t+1 V and the
    // rows are stored.
    for (int k0 = k_begin, par = 0, cur = 0; k0 < k_end; k0 += TILE, par ^= 1, cur = cur == 2 ? 0 : cur + 1) {
        const int nx1 = cur == 2 ? 0 : cur + 1, nx2 = nx1 == 2 ? 0 : nx1 + 1;   // vis_s slots of tiles +1, +2
        __syncthreads();  // every warp is done with the previous tile (v_s, k_s and m_s [par ^ 1]); vis_s[nx1] published
        cp_async_wait_all();   // this thread's copies of the tile's K landed: the barrier below shows them to all
        bool bad = false;
        store_v(vc, v_s, bad);
        // the next tile's mask rows; its K and V, and the mask of the one after, in flight
        // while this tile computes
        {
            const unsigned int vis = read_visibility(vis_s[nx1]);
            row_next = row_ahead;
            if (k0 + TILE < k_end) {
                store_mask(mk_next, m_s[par ^ 1], warp, lane);
                load_k_async(k_cache, row_next, vis, kvh, k_s[par ^ 1]);
            }
            load_v(v_cache, row_next, vis, kvh, vc);
            if (k0 + 2 * TILE < k_end) row_ahead = tile_row(pages, k0 + 2 * TILE);
        }
        load_mask(mask, k0 + 2 * TILE, k_end, mk_next, warp, lane);
        const bool bad_tile = __syncthreads_or(bad);

        // S = Q K^T: 4 n tiles of 8 keys, fragments s[n][e] at row g(+8), key 8n + 2t (+1)
        float s[TILE / 8][4];
#pragma unroll
        for (int n = 0; n < TILE / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = 0.f;
#pragma unroll
            for (int kk = 0; kk < DK; ++kk) {
                const __half* kr = &k_s[par][(8 * n + g) * KS + 16 * kk + 2 * t];
                const unsigned int bfr[2] = {ld32(kr), ld32(kr + 8)};
                mma_m16n8k16_f16(s[n], qh[kk], bfr, s[n]);
                mma_m16n8k16_f16(s[n], ql[kk], bfr, s[n]);
            }
        }

        // mask (hidden: selected to -inf, never added), online softmax (per fragment row u: g and g+8)
        float tile_max[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int n = 0; n < TILE / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int u = e >> 1, key = k0 + 8 * n + 2 * t + (e & 1);
                float v = NEG_INF;
                if (rok[u] && key < k_end) {
                    const float mk = __half2float(m_s[par][bq[u] * MS + 8 * n + 2 * t + (e & 1)]);
                    if (mk != NEG_INF) v = s[n][e] + mk * LOG2E;
                }
                s[n][e] = v;
                tile_max[u] = fmaxf(tile_max[u], v);
            }
        }
        float alpha[2];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            tile_max[u] = fmaxf(tile_max[u], __shfl_xor_sync(0xffffffffu, tile_max[u], 1));
            tile_max[u] = fmaxf(tile_max[u], __shfl_xor_sync(0xffffffffu, tile_max[u], 2));
            const float m_new = fmaxf(m_run[u], tile_max[u]);
            // nothing visible yet: keep everything at zero (and avoid -inf - -inf)
            alpha[u] = (m_new == NEG_INF) ? 1.f : exp2f(m_run[u] - m_new);
            m_run[u] = m_new;
        }
        l_run[0] *= alpha[0];
        l_run[1] *= alpha[1];
#pragma unroll
        for (int n = 0; n < TILE / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int u = e >> 1;
                const float p = (m_run[u] == NEG_INF) ? 0.f : exp2f(s[n][e] - m_run[u]);  // 0 if hidden
                s[n][e] = p;
                l_run[u] += p;
            }
#pragma unroll
        for (int j = 0; j < DN; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[j][e] *= alpha[e >> 1];

        // O += P V over the tile's two 16-key steps; V fragments for n tiles j, j+1 in one ldmatrix
#pragma unroll
        for (int kk = 0; kk < TILE / 16; ++kk) {
            unsigned int ph[4], pl[4];
            split2(s[2 * kk][0], s[2 * kk][1], ph[0], pl[0]);          // row g,   keys 2t..
            split2(s[2 * kk][2], s[2 * kk][3], ph[1], pl[1]);          // row g+8
            split2(s[2 * kk + 1][0], s[2 * kk + 1][1], ph[2], pl[2]);  // row g,   keys 2t+8..
            split2(s[2 * kk + 1][2], s[2 * kk + 1][3], ph[3], pl[3]);  // row g+8
#pragma unroll
            for (int j = 0; j < DN; j += 2) {
                unsigned int vf[4];
                ldmatrix_x4_trans(vf, &v_s[(16 * kk + lm_key) * KS + 8 * j + lm_dim]);
                const unsigned int b0[2] = {vf[0], vf[1]}, b1[2] = {vf[2], vf[3]};
                mma_m16n8k16_f16(o[j], ph, b0, o[j]);
                mma_m16n8k16_f16(o[j], pl, b0, o[j]);
                mma_m16n8k16_f16(o[j + 1], ph, b1, o[j + 1]);
                mma_m16n8k16_f16(o[j + 1], pl, b1, o[j + 1]);
            }
        }

        // Non-finite V entries of keys some row sees were staged as 0: add them
        // exactly (p * v) to the rows that see the key, and to no other row.
        // Per key, the lane's DN pairs of V in DN independent 4-byte loads.
        if (bad_tile) {
            const int row_cur = tile_row(pages, k0);   // rare: the table read again, no register held for it
#pragma unroll
            for (int n = 0; n < TILE / 8; ++n) {
                for (int kb = 0; kb < 8; ++kb) {
                    const int key = k0 + 8 * n + kb, src = (lane & ~3) | (kb >> 1);
                    float p[2];
                    bool see[2];
#pragma unroll
                    for (int u = 0; u < 2; ++u) {
                        p[u] = __shfl_sync(0xffffffffu, (kb & 1) ? s[n][2 * u + 1] : s[n][2 * u], src);
                        see[u] = rok[u] && key < k_end && __half_as_ushort(m_s[par][bq[u] * MS + 8 * n + kb]) != 0xfc00u;
                    }
                    if (!see[0] && !see[1]) continue;
                    const __half* vr = v_cache + (long long)(row_cur + (key - k0)) * KV_W + kvh * D + 2 * t;
                    unsigned int w[DN];
#pragma unroll
                    for (int j = 0; j < DN; ++j) w[j] = ld32(vr + 8 * j);
#pragma unroll
                    for (int j = 0; j < DN; ++j)
#pragma unroll
                        for (int c = 0; c < 2; ++c) {
                            const unsigned short hb = (unsigned short)(c ? w[j] >> 16 : w[j] & 0xffffu);
                            if (!half_nonfinite(hb)) continue;
                            const float hv = __half2float(__ushort_as_half(hb));
#pragma unroll
                            for (int u = 0; u < 2; ++u)
                                if (see[u]) o[j][2 * u + c] += p[u] * hv;
                        }
                }
            }
        }
        publish_visibility(mk_next, vis_s[nx2], warp, lane);   // tile +2's: read past the next barrier
    }

    // Row sums over the 4 lanes of a row, then the partial (or, unsplit, the output).
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        l_run[u] += __shfl_xor_sync(0xffffffffu, l_run[u], 1);
        l_run[u] += __shfl_xor_sync(0xffffffffu, l_run[u], 2);
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        if (!rok[u]) continue;
        const int h = kvh * G + rowr[u] % G;
        const int qrow = bq[u] * NH + h;
#if SPLITS == 1
        const float inv = l_run[u] > 0.f ? 1.f / l_run[u] : 0.f;
#pragma unroll
        for (int j = 0; j < DN; ++j)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int d = 8 * j + 2 * t + c;
                store_out(out, (long long)qrow * D + d, o[j][2 * u + c] * inv * gate_factor(gate, qrow, d));
            }
#else
        float* po = part_o + ((long long)split * (B * NH) + qrow) * D;
#pragma unroll
        for (int j = 0; j < DN; ++j)   // 8-byte pair stores (see Q's loads)
            *reinterpret_cast<float2*>(po + 8 * j + 2 * t) = make_float2(o[j][2 * u], o[j][2 * u + 1]);
        if (t == 0) {
            *reinterpret_cast<float2*>(part_ml + ((long long)split * (B * NH) + qrow) * 2) = make_float2(m_run[u], l_run[u]);
        }
#endif
    }
#if SPLITS > 1 && FOLD_MERGE
    __shared__ int ticket;
    const int unit = (int)(blockIdx.z * NKV + blockIdx.x);   // (lane, kv head)
    if (last_split_to_arrive(counters, unit, &ticket))
        merge_splits(part_o, part_ml, gate, out, kvh, 0, R, THR,
                     reinterpret_cast<float*>(k_s[0]), counters, unit);   // k_s: done with; 2R floats fit
#endif
}
