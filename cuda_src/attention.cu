// attention.cu — masked split-KV attention of the q_len noise rows of one
// layer over the whole ring cache (SPEC §2 steps 5-6, §3 step 6).
//
// Layouts (row-major, contiguous; per lane, attention_common.cuh says where each lane's slices are):
//   q        [B, NH, D] f32 (after q_norm and RoPE)
//   k_cache, v_cache [pool rows, NKV*D] f16 (kv heads fused), key k at its page's row (pages)
//   mask     [B, KV_TOTAL] f16 additive (0 visible, -inf hidden)
//   gate     GATE=1: [B, NH] f32 logits, GATE=2: [B, NH*D] f32; unused if 0
//   out      [B, NH*D] f32 = softmax(q k^T * scale + mask) v  (* softplus(gate))
//   part_o   [SPLITS, B*NH, D] f32 un-normalised partial outputs   (SPLITS > 1)
//   part_ml  [SPLITS, B*NH, 2] f32 (running max in log2 units, partial sum)
//   counters [LANES * NKV * ROW_GROUPS] int32 arrival counts, zero between launches
//            (FOLD_MERGE 1 only)
// GQA: query head h reads kv head h / (NH/NKV).
//
// ring_attn_split: grid (NKV * LANES, SPLITS, ROW_GROUPS), block (NWARPS*32):
//   blockIdx.x = lane * NKV + kv head (attention_common.cuh: lanes; the lane is
//   not folded into z: a row offset the compiler can prove 0 made ptxas spill).
//   A block takes one kv head, one contiguous slice of the kv rows and the
//   B*(NH/NKV) query rows that read that head (in groups of at most RB rows,
//   only when they do not fit shared memory at once), so each K/V tile is
//   loaded from global memory once and used by all of those rows (the tile
//   loop below says how a tile is computed).
//   With SPLITS == 1 the block normalises and writes `out` itself. With
//   SPLITS > 1 it writes its partial; then with FOLD_MERGE 1 the last of the
//   SPLITS blocks of its (lane, kv head, row group) — counters[blockIdx.x *
//   ROW_GROUPS + blockIdx.z] — merges them with log-sum-exp weights, applies
//   the gate and writes `out` (attention_common.cuh: the folded combine);
//   with FOLD_MERGE 0 ring_attn_combine does, in a second launch.
// ring_attn_combine (FOLD_MERGE 0, either split kernel): grid (ceil(B*NH*D /
//   COMBINE_THREADS), LANES), block (COMBINE_THREADS): merges the splits with
//   log-sum-exp weights, applies the gate, writes `out`.
// A row whose every key is masked gets output 0 (never NaN). A slot hidden
// from a row never reaches that row's output, whatever it holds: hidden
// scores are selected to -inf (not added), zero weights skip the P V update.
// (attention_mma.cu does the same on tensor cores; see there.)
//
// Compile-time (-D, each with a default): D (multiple of 8, <= 256), NH, NKV,
// B, KV_TOTAL (any value >= 1), SPLITS, RB (query rows per block), NWARPS,
// GATE (0 none, 1 per head, 2 per element), FOLD_MERGE.
// nvrtc-check: -DD=32 -DNH=4 -DNKV=4 -DB=1 -DKV_TOTAL=37 -DSPLITS=1 -DGATE=1 -DRB=4 -DNWARPS=4
// nvrtc-check: -DD=64 -DNH=8 -DNKV=2 -DB=16 -DKV_TOTAL=100 -DSPLITS=3 -DGATE=2 -DRB=64 -DNWARPS=8
// nvrtc-check: -DD=256 -DNH=16 -DNKV=4 -DB=16 -DKV_TOTAL=1000 -DSPLITS=2 -DRB=16 -DNWARPS=8
// nvrtc-check: -DD=64 -DNH=8 -DNKV=2 -DB=16 -DKV_TOTAL=100 -DSPLITS=3 -DGATE=2 -DRB=64 -DNWARPS=8 -DFOLD_MERGE=0
// nvrtc-check: -DD=128 -DNH=64 -DNKV=8 -DB=16 -DKV_TOTAL=4128 -DSPLITS=8 -DGATE=1 -DRB=64 -DNWARPS=8
// nvrtc-check: -DD=128 -DNH=64 -DNKV=8 -DB=16 -DKV_TOTAL=4128 -DSPLITS=8 -DGATE=2 -DRB=64 -DNWARPS=8 -DLANES=64 -DLANE_ROWS=32 -DPAGE=64
// nvrtc-check: -DD=64 -DNH=8 -DNKV=2 -DB=16 -DKV_TOTAL=100 -DSPLITS=3 -DGATE=2 -DRB=64 -DNWARPS=8 -DFOLD_MERGE=0 -DOUT16=2
// nvrtc-check: -DD=32 -DNH=4 -DNKV=4 -DB=1 -DKV_TOTAL=37 -DSPLITS=3 -DGATE=1 -DRB=4 -DNWARPS=4 -DOUT16=1
#include <cuda_fp16.h>
#include "attention_common.cuh"
#include "pdl.cuh"

#ifndef RB
#define RB (R < 64 ? R : 64)
#endif
#ifndef NWARPS
#define NWARPS (RB < 8 ? RB : 8)
#endif

#define NT (NWARPS * 32)
#define CPR (D / 8)                       // 16-byte chunks per head row
#define DPL ((D + 31) / 32)               // output dims per lane
#define RPW ((RB + NWARPS - 1) / NWARPS)  // query rows per warp
// swizzle width: the largest power of two <= 8 dividing CPR, so c ^ (t & SWZ)
// stays inside the row
#define SWZ ((CPR % 8 == 0) ? 7 : (CPR % 4 == 0) ? 3 : (CPR % 2 == 0) ? 1 : 0)

__device__ __forceinline__ void half8_to_float(const uint4& c, float* f) {
    const __half2* h = reinterpret_cast<const __half2*>(&c);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const float2 v = __half22float2(h[e]);
        f[2 * e] = v.x;
        f[2 * e + 1] = v.y;
    }
}

extern "C" __global__ void __launch_bounds__(NT)
ring_attn_split(const float* __restrict__ q,
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
    __shared__ __align__(16) float q_s[RB * D];
    __shared__ __align__(16) uint4 k_s[TILE * CPR];
    __shared__ __align__(16) uint4 v_s[TILE * CPR];

    const int lane_id = LANES == 1 ? 0 : (int)blockIdx.x / NKV;   // the request (attention_common.cuh: lanes)
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
    const int kvh = (int)blockIdx.x - lane_id * NKV;
    const int split = blockIdx.y;
    const int row0 = blockIdx.z * RB;           // first query row (b*G + g) of this block
    const int rows_here = min(RB, R - row0);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int k_begin = split * SPLIT_KEYS;
    const int k_end = min(KV_TOTAL, k_begin + SPLIT_KEYS);

    // query rows of this block, pre-scaled so that exp2 gives the softmax
    const float qscale = scale * LOG2E;
    for (int i = threadIdx.x; i < RB * D; i += NT) {
        const int r = i / D, d = i % D;
        float v = 0.f;
        if (r < rows_here) {
            const int rg = row0 + r;
            const int b = rg / G, h = kvh * G + rg % G;
            v = q[((long long)b * NH + h) * D + d] * qscale;
        }
        q_s[i] = v;
    }

    float acc[RPW][DPL];
    float m_run[RPW], l_run[RPW];
#pragma unroll
    for (int rr = 0; rr < RPW; ++rr) {
        m_run[rr] = NEG_INF;
        l_run[rr] = 0.f;
#pragma unroll
        for (int j = 0; j < DPL; ++j) acc[rr][j] = 0.f;
    }

    const __half* v_h = reinterpret_cast<const __half*>(v_s);

    // Per 32-key tile: lane t of every warp owns key t. The score of (row, t)
    // is a full dot product read from shared memory (K tile stored with an XOR
    // swizzle of its 16-byte chunks so the 32 lanes reading 32 different rows
    // hit distinct banks); online softmax in f32 in the log2 domain (q is
    // pre-scaled by scale*log2(e)); the P·V product broadcasts p_t with a
    // shuffle while lane owns output dims lane + 32*j. The lane keeps a partial
    // softmax denominator, reduced once at the end.
    // the tile's keys: consecutive rows of one page; its first row from the page table, loaded
    // one tile ahead (no round trip before the tile's K/V loads)
    int row_k = k_begin < k_end ? tile_row(pages, k_begin) : 0;
    for (int k0 = k_begin; k0 < k_end; k0 += TILE) {
        __syncthreads();  // previous tile fully consumed (and q_s written, first time)
        const long long row0_k = row_k;   // 64-bit: times KV_W below
        if (k0 + TILE < k_end) row_k = tile_row(pages, k0 + TILE);
        for (int i = threadIdx.x; i < TILE * CPR; i += NT) {
            const int t = i / CPR, c = i % CPR;
            const int key = k0 + t;
            uint4 kc = make_uint4(0u, 0u, 0u, 0u), vc = make_uint4(0u, 0u, 0u, 0u);
            if (key < k_end) {
                const long long off = (row0_k + t) * KV_W + kvh * D + c * 8;
                kc = *reinterpret_cast<const uint4*>(k_cache + off);
                vc = *reinterpret_cast<const uint4*>(v_cache + off);
            }
            k_s[t * CPR + (c ^ (t & SWZ))] = kc;
            v_s[i] = vc;
        }
        __syncthreads();

        const int key = k0 + lane;
        const bool key_ok = key < k_end;

        // scores of this lane's key for every row of the warp
        float s[RPW];
#pragma unroll
        for (int rr = 0; rr < RPW; ++rr) s[rr] = 0.f;
#pragma unroll 4
        for (int c = 0; c < CPR; ++c) {
            float kf[8];
            half8_to_float(k_s[lane * CPR + (c ^ (lane & SWZ))], kf);
#pragma unroll
            for (int rr = 0; rr < RPW; ++rr) {
                const int r = rr * NWARPS + warp;
                if (r < RB) {
                    const float4 qa = *reinterpret_cast<const float4*>(&q_s[r * D + c * 8]);
                    const float4 qb = *reinterpret_cast<const float4*>(&q_s[r * D + c * 8 + 4]);
                    s[rr] += qa.x * kf[0] + qa.y * kf[1] + qa.z * kf[2] + qa.w * kf[3]
                           + qb.x * kf[4] + qb.y * kf[5] + qb.z * kf[6] + qb.w * kf[7];
                }
            }
        }

        float p[RPW];
#pragma unroll
        for (int rr = 0; rr < RPW; ++rr) {
            p[rr] = 0.f;
            const int r = rr * NWARPS + warp;
            if (r >= rows_here) continue;  // warp-uniform
            const int b = (row0 + r) / G;
            // a hidden key's score is selected, never added: its K row may hold NaN/Inf
            float sc = NEG_INF;
            if (key_ok) {
                const float mk = __half2float(mask[(long long)b * KV_TOTAL + key]);
                if (mk != NEG_INF) sc = s[rr] + mk * LOG2E;
            }
            const float m_new = fmaxf(m_run[rr], warp_max(sc));
            if (m_new == NEG_INF) continue;  // nothing visible yet: stay at zero
            const float alpha = exp2f(m_run[rr] - m_new);  // 0 when m_run was -inf
            p[rr] = exp2f(sc - m_new);                     // 0 for hidden keys
            l_run[rr] = l_run[rr] * alpha + p[rr];
            m_run[rr] = m_new;
#pragma unroll
            for (int j = 0; j < DPL; ++j) acc[rr][j] *= alpha;
        }

        const int n_keys = min(TILE, k_end - k0);
        for (int t = 0; t < n_keys; ++t) {
            float vt[DPL];
#pragma unroll
            for (int j = 0; j < DPL; ++j) {
                const int d = lane + 32 * j;
                vt[j] = d < D ? __half2float(v_h[t * D + d]) : 0.f;
            }
#pragma unroll
            for (int rr = 0; rr < RPW; ++rr) {
                const int r = rr * NWARPS + warp;
                if (r < rows_here) {
                    const float pt = __shfl_sync(0xffffffffu, p[rr], t);
                    // p = 0 (hidden or underflowed) adds nothing, so skipping it is exact,
                    // and a hidden V row holding NaN/Inf never meets 0 x NaN (warp-uniform)
                    if (pt != 0.f) {
#pragma unroll
                        for (int j = 0; j < DPL; ++j) acc[rr][j] += pt * vt[j];
                    }
                }
            }
        }
    }

#pragma unroll
    for (int rr = 0; rr < RPW; ++rr) {
        const int r = rr * NWARPS + warp;
        if (r >= rows_here) continue;
        const int rg = row0 + r;
        const int b = rg / G, h = kvh * G + rg % G;
        const int qrow = b * NH + h;
        const float l = warp_sum(l_run[rr]);
#if SPLITS == 1
        const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
        for (int j = 0; j < DPL; ++j) {
            const int d = lane + 32 * j;
            if (d < D) store_out(out, (long long)qrow * D + d, acc[rr][j] * inv * gate_factor(gate, qrow, d));
        }
#else
        float* po = part_o + ((long long)split * (B * NH) + qrow) * D;
#pragma unroll
        for (int j = 0; j < DPL; ++j) {
            const int d = lane + 32 * j;
            if (d < D) po[d] = acc[rr][j];
        }
        if (lane == 0) {
            part_ml[((long long)split * (B * NH) + qrow) * 2] = m_run[rr];
            part_ml[((long long)split * (B * NH) + qrow) * 2 + 1] = l;
        }
#endif
    }
#if SPLITS > 1 && FOLD_MERGE
    // the ticket (q_s[0]) and the merge's row scratch (q_s[4 ..]) reuse q_s, written only
    // after the barrier that ends every thread's use of it: RB is sized so that q_s and
    // the tiles fill the static shared memory (RB * D >= 4 + 2 * RB: D >= 8)
    const int unit = (int)(blockIdx.x * gridDim.z + blockIdx.z);   // (lane, kv head, row group)
    if (last_split_to_arrive(counters, unit, reinterpret_cast<int*>(q_s)))
        merge_splits(part_o, part_ml, gate, out, kvh, row0, row0 + rows_here, NT, q_s + 4, counters, unit);
#endif
}

extern "C" __global__ void __launch_bounds__(COMBINE_THREADS)
ring_attn_combine(const float* __restrict__ part_o,
                  const float* __restrict__ part_ml,
                  const float* __restrict__ gate,
                  OUT_T* __restrict__ out,
                  const int* __restrict__ live,
                  int use_live)
{
    pdl_wait();  // pdl.cuh: everything below may read what the kernel before wrote
    pdl_launch_dependents();
    const int lane_id = LANES == 1 ? 0 : (int)blockIdx.y;
    if (lane_idle(live, use_live, lane_id)) return;
    {
        const LaneOffsets lo = lane_offsets(lane_id);
        part_o += lo.part_o;
        part_ml += lo.part_ml;
        gate += lo.gate;
        out += lo.q_o;
    }
    const int i = blockIdx.x * COMBINE_THREADS + threadIdx.x;
    if (i >= B * NH * D) return;
    const int qrow = i / D, d = i % D;
    // Every split's (m, l) pair (one 8-byte load each) and o value, and the gate, are loaded
    // into registers of their own before the sums: the (m, l) pairs in one batch and the o
    // values in another (profiling/sass.py), where the loop that reloaded part_ml made seven.
    float2 ml[SPLITS];
    float po[SPLITS];
#pragma unroll
    for (int s = 0; s < SPLITS; ++s) {
        const long long r = (long long)s * (B * NH) + qrow;
        ml[s] = *reinterpret_cast<const float2*>(part_ml + r * 2);
        po[s] = part_o[r * D + d];
    }
    const float g = gate_factor(gate, qrow, d);
    float m = NEG_INF;
#pragma unroll
    for (int s = 0; s < SPLITS; ++s) m = fmaxf(m, ml[s].x);
    float o = 0.f, l = 0.f;
    if (m != NEG_INF) {
#pragma unroll
        for (int s = 0; s < SPLITS; ++s) {
            const float w = exp2f(ml[s].x - m);  // 0 for empty / fully hidden splits
            l += w * ml[s].y;
            o += w * po[s];
        }
    }
    store_out(out, i, (l > 0.f ? o / l : 0.f) * g);
}
