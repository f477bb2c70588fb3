// emu_counters.h — part of cuda_emu.h (included by it only, after the parts before it).
// Counters (modules built with -DEMU_COUNTERS=1): global sectors, shared-memory
// wavefronts and bank conflicts, MMAs, per warp-level instruction.
#pragma once

// ---------------------------------------------------------------- counters
// Counter mode (emu_launch_counted): every access of kernel code that the memory
// checks see is also counted, per warp-level instruction as the GPU would issue
// it. Lanes run one after another as fibers, so an instruction is rebuilt from
// its lanes' accesses: same warp, same site (the return address of the hook, in
// the kernel's code) and the same occurrence of that site in each lane since the
// block's last barrier; groups are complete at a barrier and at the block's end.
// Rules (the same arithmetic as profiling/counters.py):
//  - global: one request per instruction with an active lane; sectors = distinct
//    32-byte sectors its lanes touch; bytes = width x active lanes;
//  - shared: phases of 32 / max(1, w / 4) lanes (w = width: all 32 lanes up to 4 B,
//    16 for 8 B, 8 for 16 B); per phase the most distinct 4-byte words any one of
//    the 32 banks must deliver (lanes reading one word share it); ideal =
//    ceil(active lanes x w / 128);
//  - a vector type (float4, uint2, half2, ...) counts as the one access it is on
//    the GPU (count_vector) and the pieces g++ splits its copy into do not;
//    ldmatrix counts its lanes' 16-byte rows (phases of 8 rows: one per matrix),
//    not its emulated gathers; mma.sync once per warp, __syncthreads once per block;
//  - wgmma.mma_async: once per warpgroup instruction (CNT_WGMMA, counted by its first warp),
//    N / 8 m16n8k16 equivalents per warp (CNT_WGMMA_MMA), and the bytes of B it reads from
//    shared memory, N x 16 x 2 per warpgroup instruction (CNT_WGMMA_SMEM_BYTES; not in the
//    shared-load counts, which are per lane access);
//  - fiber-stack (local) accesses are not counted: on the GPU they are registers.
// Per range (pointer argument): bytes requested (read, written) and distinct bytes
// (a byte mask per 32-byte sector over the whole launch).
// PDL (cuda_src/pdl.cuh): per sector also the bytes read / written by threads that had
// not yet run pdl_wait(), prefetch_l2()'s lines among the reads (not in any count
// above: a prefetch is no load); CNT_PDL_* count the blocks with a thread past its
// wait, the threads that waited, and the threads that triggered their dependents
// before waiting. emu_pdl_export hands the sector table to the ordering check
// (dflash_cupy/emu/pdl_order.py).
enum : int { CNT_GLD_REQ, CNT_GLD_SEC, CNT_GLD_BYTES, CNT_GST_REQ, CNT_GST_SEC, CNT_GST_BYTES,
             CNT_SLD_REQ, CNT_SLD_WF, CNT_SLD_IDEAL, CNT_SST_REQ, CNT_SST_WF, CNT_SST_IDEAL,
             CNT_MMA, CNT_BARRIERS, CNT_BLOCKS, CNT_OTHER_ACC, CNT_OTHER_BYTES, CNT_SITES_MERGED,
             CNT_WGMMA, CNT_WGMMA_MMA, CNT_WGMMA_SMEM_BYTES, CNT_PDL_WAITED_BLOCKS, CNT_PDL_WAITS,
             CNT_PDL_EARLY_TRIGGERS, CNT_TOTALS = 24, CNT_PER_RANGE = 8 };
// then per range: bytes read, written, distinct read, distinct written, load requests, load
// sectors, store requests, store sectors (an instruction counts for its first lane's range)

struct CntOcc { unsigned long long site; int tid; unsigned n; };
struct CntSlot { unsigned long long site; int warp; unsigned occ; int store; int idx; };
struct CntGroup { unsigned long long addr[32], site; unsigned lanes, width; int space, store, range, warp; };
struct CntSec { unsigned long long key; unsigned rd, wr, prd, pwr; };  // p*: before pdl_wait
// Per site (instruction of the g++ build): what its warp-level executions cost, and how many
// each warp made (the busiest warp's count bounds a serial loop's issue: one warp issues one
// instruction a clock, whatever the others do; warps past 32 count in warp 31).
struct CntSite { unsigned long long site, kind, width, requests, units, ideal, bytes, warp_req[32]; };  // kind = store | space << 1
enum : int { CNT_SITE_VALS = 8 };
struct Count {
    unsigned long long* out;
    int nranges;
    CntOcc* occ; unsigned occ_bits, occ_used;
    CntSlot* gt; unsigned gt_bits, gt_used;
    CntGroup* g; unsigned ng, g_cap;
    CntSec* sec; unsigned sec_bits, sec_used;
    CntSite* st; unsigned st_n, st_cap;   // a short list: kernels have few hundred sites
};

EMU_INTERNAL static inline unsigned cnt_hash(unsigned long long k, unsigned bits) {
    return (unsigned)((k * 0x9e3779b97f4a7c15ULL) >> (64 - bits));
}

EMU_INTERNAL static void cnt_init(Count* c, unsigned long long* out, int nranges) {
    std::memset(c, 0, sizeof *c);
    c->out = out;
    c->nranges = nranges;
    c->occ_bits = 12; c->occ = (CntOcc*)calloc(1u << 12, sizeof(CntOcc));
    c->gt_bits = 12; c->gt = (CntSlot*)calloc(1u << 12, sizeof(CntSlot));
    c->g_cap = 1024; c->g = (CntGroup*)malloc(c->g_cap * sizeof(CntGroup));
    c->sec_bits = 14; c->sec = (CntSec*)calloc(1u << 14, sizeof(CntSec));
    c->st_cap = 256; c->st = (CntSite*)calloc(c->st_cap, sizeof(CntSite));
}

EMU_INTERNAL static void cnt_free(Count* c) {
    free(c->occ); free(c->gt); free(c->g); free(c->sec); free(c->st);
    c->occ = nullptr; c->gt = nullptr; c->g = nullptr; c->sec = nullptr; c->st = nullptr;
}

// The lane's occurrence number of `site` since the last barrier (0, 1, ...).
EMU_INTERNAL static unsigned cnt_occurrence(Count* c, unsigned long long site, int tid) {
    if (2 * (c->occ_used + 1) > (1u << c->occ_bits)) {  // grow: rehash into twice the slots
        const unsigned ob = c->occ_bits;
        CntOcc* old = c->occ;
        c->occ_bits = ob + 1;
        c->occ = (CntOcc*)calloc(1u << c->occ_bits, sizeof(CntOcc));
        for (unsigned i = 0; i < (1u << ob); i++) {
            if (!old[i].site) continue;
            unsigned h = cnt_hash(old[i].site ^ ((unsigned long long)old[i].tid << 48), c->occ_bits);
            while (c->occ[h].site) h = (h + 1) & ((1u << c->occ_bits) - 1);
            c->occ[h] = old[i];
        }
        free(old);
    }
    const unsigned mask = (1u << c->occ_bits) - 1;
    unsigned h = cnt_hash(site ^ ((unsigned long long)tid << 48), c->occ_bits);
    for (;;) {
        CntOcc& e = c->occ[h];
        if (!e.site) { e.site = site; e.tid = tid; e.n = 1; c->occ_used++; return 0; }
        if (e.site == site && e.tid == tid) return e.n++;
        h = (h + 1) & mask;
    }
}

EMU_INTERNAL static CntGroup* cnt_group(Count* c, int warp, unsigned long long site, unsigned occ, int store,
                                        int space, int range) {
    if (2 * (c->gt_used + 1) > (1u << c->gt_bits)) {
        const unsigned ob = c->gt_bits;
        CntSlot* old = c->gt;
        c->gt_bits = ob + 1;
        c->gt = (CntSlot*)calloc(1u << c->gt_bits, sizeof(CntSlot));
        for (unsigned i = 0; i < (1u << ob); i++) {
            if (!old[i].idx) continue;
            unsigned h = cnt_hash(old[i].site ^ ((unsigned long long)old[i].occ << 32) ^
                                  ((unsigned long long)old[i].warp << 56) ^ (unsigned long long)old[i].store,
                                  c->gt_bits);
            while (c->gt[h].idx) h = (h + 1) & ((1u << c->gt_bits) - 1);
            c->gt[h] = old[i];
        }
        free(old);
    }
    const unsigned mask = (1u << c->gt_bits) - 1;
    unsigned h = cnt_hash(site ^ ((unsigned long long)occ << 32) ^ ((unsigned long long)warp << 56) ^
                          (unsigned long long)store, c->gt_bits);
    for (;;) {
        CntSlot& e = c->gt[h];
        if (!e.idx) break;
        if (e.site == site && e.warp == warp && e.occ == occ && e.store == store) return &c->g[e.idx - 1];
        h = (h + 1) & mask;
    }
    if (c->ng == c->g_cap) {
        c->g_cap *= 2;
        c->g = (CntGroup*)realloc(c->g, c->g_cap * sizeof(CntGroup));
    }
    CntGroup* g = &c->g[c->ng++];
    g->site = site;
    g->lanes = 0;
    g->width = 0;
    g->space = space;
    g->store = store;
    g->range = range;
    g->warp = warp;
    CntSlot& e = c->gt[h];
    e.site = site; e.warp = warp; e.occ = occ; e.store = store; e.idx = (int)c->ng;
    c->gt_used++;
    return g;
}

// Distinct bytes per range: a byte mask per (range, 32-byte sector).
// kind: 0 load, 1 store, 2 a prefetch (only its pre-wait bit); pre: before the thread's pdl_wait.
EMU_INTERNAL static void cnt_bytes(Count* c, int range, unsigned long long a, unsigned long long n, int kind,
                                   bool pre) {
    for (unsigned long long s = a >> 5; s <= (a + n - 1) >> 5; s++) {
        const unsigned long long b0 = s << 5 > a ? s << 5 : a, b1 = (s << 5) + 32 < a + n ? (s << 5) + 32 : a + n;
        const unsigned bits = (unsigned)((b1 - b0 >= 32 ? 0xffffffffULL : ((1ULL << (b1 - b0)) - 1)) << (b0 & 31));
        if (2 * (c->sec_used + 1) > (1u << c->sec_bits)) {
            const unsigned ob = c->sec_bits;
            CntSec* old = c->sec;
            c->sec_bits = ob + 1;
            c->sec = (CntSec*)calloc(1u << c->sec_bits, sizeof(CntSec));
            for (unsigned i = 0; i < (1u << ob); i++) {
                if (!old[i].key) continue;
                unsigned h = cnt_hash(old[i].key, c->sec_bits);
                while (c->sec[h].key) h = (h + 1) & ((1u << c->sec_bits) - 1);
                c->sec[h] = old[i];
            }
            free(old);
        }
        const unsigned long long key = ((s << 7) | (unsigned long long)range) + 1;
        unsigned h = cnt_hash(key, c->sec_bits);
        const unsigned mask = (1u << c->sec_bits) - 1;
        while (c->sec[h].key && c->sec[h].key != key) h = (h + 1) & mask;
        CntSec& e = c->sec[h];
        if (!e.key) { e.key = key; c->sec_used++; }
        if (kind == 1) e.wr |= bits; else if (kind == 0) e.rd |= bits;
        if (pre) { if (kind == 1) e.pwr |= bits; else e.prd |= bits; }
    }
}

EMU_INTERNAL static void cnt_site(Count* c, const CntGroup& g, unsigned long long units, unsigned long long ideal,
                                  unsigned long long bytes) {
    const unsigned long long kind = (unsigned long long)g.store | ((unsigned long long)g.space << 1);
    unsigned i = 0;
    while (i < c->st_n && !(c->st[i].site == g.site && c->st[i].kind == kind)) i++;
    if (i == c->st_n) {
        if (c->st_n == c->st_cap) {
            c->st_cap *= 2;
            c->st = (CntSite*)realloc(c->st, c->st_cap * sizeof(CntSite));
        }
        CntSite& e = c->st[c->st_n++];
        std::memset(&e, 0, sizeof e);
        e.site = g.site;
        e.kind = kind;
    }
    CntSite& e = c->st[i];
    if (g.width > e.width) e.width = g.width;
    e.requests++;
    e.warp_req[g.warp < 0 ? 0 : (g.warp > 31 ? 31 : g.warp)]++;
    e.units += units;
    e.ideal += ideal;
    e.bytes += bytes;
}

// Counts the instructions gathered since the last barrier; starts a new interval.
EMU_INTERNAL static void cnt_flush(Count* c) {
    unsigned long long* o = c->out;
    for (unsigned i = 0; i < c->ng; i++) {
        const CntGroup& g = c->g[i];
        const unsigned w = g.width ? g.width : 1;
        const int active = __builtin_popcount(g.lanes);
        if (g.space == 0) {
            unsigned long long secs[96];
            int ns = 0;
            for (int l = 0; l < 32; l++) {
                if (!((g.lanes >> l) & 1u)) continue;
                for (unsigned long long s = g.addr[l] >> 5; s <= (g.addr[l] + w - 1) >> 5; s++) {
                    int j = 0;
                    while (j < ns && secs[j] != s) j++;
                    if (j == ns && ns < 96) secs[ns++] = s;
                }
            }
            o[g.store ? CNT_GST_REQ : CNT_GLD_REQ] += 1;
            o[g.store ? CNT_GST_SEC : CNT_GLD_SEC] += (unsigned long long)ns;
            o[g.store ? CNT_GST_BYTES : CNT_GLD_BYTES] += (unsigned long long)w * active;
            if (g.range >= 0 && g.range < c->nranges) {
                unsigned long long* pr = o + CNT_TOTALS + CNT_PER_RANGE * g.range + (g.store ? 6 : 4);
                pr[0] += 1;
                pr[1] += (unsigned long long)ns;
            }
            const unsigned long long nb = (unsigned long long)w * active;
            cnt_site(c, g, (unsigned long long)ns, (nb + 31) / 32, nb);
        } else {
            const int per_phase = w <= 4 ? 32 : (w <= 8 ? 16 : 8);
            unsigned long long wf = 0;
            for (int p0 = 0; p0 < 32; p0 += per_phase) {
                unsigned long long words[64];
                int nw = 0;
                for (int l = p0; l < p0 + per_phase; l++) {
                    if (!((g.lanes >> l) & 1u)) continue;
                    for (unsigned long long wd = g.addr[l] >> 2; wd <= (g.addr[l] + w - 1) >> 2; wd++) {
                        int j = 0;
                        while (j < nw && words[j] != wd) j++;
                        if (j == nw && nw < 64) words[nw++] = wd;
                    }
                }
                int per_bank[32] = {0};
                int most = 0;
                for (int j = 0; j < nw; j++) {
                    const int b = (int)(words[j] & 31);
                    if (++per_bank[b] > most) most = per_bank[b];
                }
                wf += (unsigned long long)most;
            }
            const unsigned long long ideal = ((unsigned long long)active * w + 127) / 128;
            o[g.store ? CNT_SST_REQ : CNT_SLD_REQ] += 1;
            o[g.store ? CNT_SST_WF : CNT_SLD_WF] += wf;
            o[g.store ? CNT_SST_IDEAL : CNT_SLD_IDEAL] += ideal ? ideal : 1;
            cnt_site(c, g, wf, ideal ? ideal : 1, (unsigned long long)w * active);
        }
    }
    c->ng = 0;
    if (c->gt_used) { std::memset(c->gt, 0, sizeof(CntSlot) << c->gt_bits); c->gt_used = 0; }
    if (c->occ_used) { std::memset(c->occ, 0, sizeof(CntOcc) << c->occ_bits); c->occ_used = 0; }
}

EMU_INTERNAL static void cnt_finish(Count* c, unsigned long long* sites_out, int max_sites) {
    cnt_flush(c);
    if (sites_out && max_sites > 0) {  // [0] = sites listed, then CNT_SITE_VALS per site
        const unsigned n = c->st_n < (unsigned)max_sites ? c->st_n : (unsigned)max_sites;
        sites_out[0] = c->st_n;
        for (unsigned i = 0; i < n; i++) {
            const CntSite& e = c->st[i];
            unsigned long long* v = sites_out + 1 + (unsigned long long)CNT_SITE_VALS * i;
            v[0] = e.site; v[1] = e.kind; v[2] = e.width; v[3] = e.requests; v[4] = e.units; v[5] = e.ideal;
            v[6] = e.bytes;
            v[7] = 0;
            for (int w = 0; w < 32; w++) v[7] = e.warp_req[w] > v[7] ? e.warp_req[w] : v[7];
        }
    }
    for (unsigned i = 0; i < (1u << c->sec_bits); i++) {
        const CntSec& e = c->sec[i];
        if (!e.key) continue;
        const int r = (int)((e.key - 1) & 127);
        if (r >= c->nranges) continue;
        unsigned long long* pr = c->out + CNT_TOTALS + CNT_PER_RANGE * r;
        pr[2] += (unsigned long long)__builtin_popcount(e.rd);
        pr[3] += (unsigned long long)__builtin_popcount(e.wr);
    }
}

// 0 global (range in *range), 1 shared, 2 the lane's own stack, 3 anything else.
EMU_INTERNAL static inline int cnt_space(const MemTable* t, const Fiber* f, unsigned long long a, int* range) {
    for (int i = 0; i < t->n; i++)
        if (a >= t->r[i].d0 && a < t->r[i].d1) { *range = t->r[i].arg; return 0; }
    for (int i = 0; i < t->nsh; i++)
        if (a - t->sh[i].lo < t->sh[i].len) return 1;
    if (f->stack && a - (unsigned long long)f->stack < STACK_BYTES) return 2;
    // threadIdx, blockIdx, blockDim, gridDim: special registers on the GPU
    if (a == (unsigned long long)&tl_fiber || a == (unsigned long long)&tl_block) return 2;
    const Block* b = tl_block;
    if (b && (a - (unsigned long long)b->fibers < (unsigned long long)b->nthreads * sizeof(Fiber) ||
              a - (unsigned long long)b < sizeof(Block)))
        return 2;
    return 3;
}

EMU_INTERNAL static void cnt_record(Count* c, Fiber* f, unsigned long long a, unsigned long long n, bool store,
                                    int space, int range, unsigned long long site) {
    if (space == 0 && range < c->nranges) {
        c->out[CNT_TOTALS + CNT_PER_RANGE * range + (store ? 1 : 0)] += n;
        cnt_bytes(c, range, a, n, store ? 1 : 0, !f->pdl_waited);
    }
    const unsigned occ = cnt_occurrence(c, site, f->tid);
    CntGroup* g = cnt_group(c, f->tid >> 5, site, occ, store, space, range);
    const int lane = f->tid & 31;
    g->addr[lane] = a;
    g->lanes |= 1u << lane;
    if (n > g->width) g->width = (unsigned)n;
}

// An access seen by the memory checks (counter mode on).
EMU_INTERNAL __attribute__((noinline)) static void count_access(unsigned long long a, unsigned long long n,
                                                                bool store, unsigned long long site) {
    MemTable* t = tl_mem;
    Fiber* f = tl_fiber;
    Count* c = (Count*)tl_cnt;
    if (!t || !f || !c || f->cnt_mute || !n) return;
    int range = -1;
    const int space = cnt_space(t, f, a, &range);
    if (space == 2) return;
    if (space == 3) { c->out[CNT_OTHER_ACC]++; c->out[CNT_OTHER_BYTES] += n; return; }
    const int k = store ? 1 : 0;
    if (f->cv_left[k]) {  // a piece of the vector access just counted
        if (a >= f->cv_lo[k] && a + n <= f->cv_hi[k]) {
            f->cv_left[k] = f->cv_left[k] > n ? f->cv_left[k] - n : 0;
            return;
        }
        f->cv_left[k] = 0;
    }
    cnt_record(c, f, a, n, store, space, range, site);
}

__attribute__((noinline)) EMU_INTERNAL static void count_vector(const void* p, unsigned n, bool store) {
    MemTable* t = tl_mem;
    Fiber* f = tl_fiber;
    Count* c = (Count*)tl_cnt;
    if (!t || !f || !c || f->cnt_mute) return;
    const unsigned long long a = (unsigned long long)p;
    int range = -1;
    const int space = cnt_space(t, f, a, &range);
    if (space == 2) return;
    if (space == 3) { c->out[CNT_OTHER_ACC]++; c->out[CNT_OTHER_BYTES] += n; return; }
    const int k = store ? 1 : 0;
    f->cv_lo[k] = a;
    f->cv_hi[k] = a + n;
    f->cv_left[k] = n;
    cnt_record(c, f, a, n, store, space, range, (unsigned long long)__builtin_return_address(0));
}

// ldmatrix.x4: each lane's 16-byte row, one shared-memory instruction; the
// emulation's gathers that follow (until emu_ldmatrix_end) are not counted.
__attribute__((noinline)) EMU_INTERNAL static void count_ldmatrix(const void* row) {
    MemTable* t = tl_mem;
    Fiber* f = tl_fiber;
    Count* c = (Count*)tl_cnt;
    if (!t || !f || !c) return;
    int range = -1;
    const unsigned long long a = (unsigned long long)row;
    const int space = cnt_space(t, f, a, &range);
    if (space == 0 || space == 1)
        cnt_record(c, f, a, 16, false, space, range, (unsigned long long)__builtin_return_address(0));
    f->cnt_mute = 1;
}

// The sector table of the current counted launch, for emu_pdl_export (set per launch).
static thread_local unsigned long long* tl_pdl_out;
static thread_local unsigned long long tl_pdl_cap;

// [0] = entries, then 3 per (range, sector): address of the sector, rd | wr << 32, prd | pwr << 32.
EMU_INTERNAL static void pdl_export(const Count* c) {
    unsigned long long* o = tl_pdl_out;
    if (!o) return;
    unsigned long long n = 0;
    for (unsigned i = 0; i < (1u << c->sec_bits); i++) {
        const CntSec& e = c->sec[i];
        if (!e.key) continue;
        if (n < tl_pdl_cap) {
            unsigned long long* v = o + 1 + 3 * n;
            v[0] = ((e.key - 1) >> 7) << 5;
            v[1] = (unsigned long long)e.rd | ((unsigned long long)e.wr << 32);
            v[2] = (unsigned long long)e.prd | ((unsigned long long)e.pwr << 32);
        }
        n++;
    }
    o[0] = n;
    tl_pdl_out = nullptr;
}

EMU_INTERNAL static void count_barrier() {
    Count* c = (Count*)tl_cnt;
    c->out[CNT_BARRIERS]++;
    cnt_flush(c);
}

EMU_INTERNAL static void count_mma() { ((Count*)tl_cnt)->out[CNT_MMA]++; }
