// emu_tensor_core.h — part of cuda_emu.h (included by it only, after the parts before it).
// Tensor-core instructions: wgmma.mma_async (issue, commit and wait groups,
// descriptors), with the GPU's asynchrony made visible.
#pragma once

// ---------------------------------------------------------------- wgmma
// wgmma.mma_async (cuda_src/wgmma.cuh), the register-A / shared-B form, f32 accumulators.
// On the GPU the MMA runs asynchronously between its issue and the wgmma.wait_group that
// retires its commit group; the emulator must not be kinder than that, so:
//  - issue is a warp collective (all 32 lanes, like mma.sync): the warp's A tile (16 x 16, its
//    rows of the warpgroup's 64), the descriptor, N, the type and scale_d are recorded once
//    per warp, checked (descriptor fields, shared-memory bounds of every core matrix it
//    names, agreement of the lanes, a whole number of warpgroups in the block, a
//    wgmma_fence since the thread last had nothing in flight), and each lane notes the record
//    and its accumulator pointer in its own pending list, tagged with its open group;
//  - commit_group closes the thread's open group; wait_group<n> computes, for that thread
//    only, its accumulators of every wgmma in its committed groups but the newest n, oldest
//    first, reading B from shared memory then: d read before the wait is the old value, and
//    B overwritten before the wait changes the result (as it may on the GPU);
//  - a thread that exits with wgmmas in flight (not waited for, or never committed) fails
//    the launch, and so does a wait that finds the thread's A registers or accumulators of a
//    wgmma it retires changed since the issue (written too early; reads cannot be seen, but
//    they see the old values).
// Arithmetic: per element and k16 step, D = (scale_d ? D : 0) + sum of 16 products, in double
// with one rounding to f32 (resolve_mma's rule; the hardware's f32 accumulation differs in the
// last bits). Descriptor addresses are offsets in a shared-memory window the emulator lays out
// per block: the block's shared arrays (static, then the extern buffer, as noted before the
// block) one after another, 16-byte aligned as their host addresses are.
// Not checked: fence.proxy.async between generic smem writes and the wgmma (a no-op here),
// that the 4 warps of a warpgroup issue the same sequence, register reuse between a wgmma and
// the wgmma_fence that should precede it once the thread has wgmmas in flight.
// Per thread: 2 commit groups of gemm_wgmma.cu with hi + lo, 2 sets and 4 chunks are 128.
enum : int { WG_MAX_PENDING = 256 };
struct WgLaneArgs {  // one lane's operands at issue
    float* d;
    const unsigned int* a;
    unsigned long long desc;
    int n, bf16, scale_d;
};
struct WgRec {  // one warp's share of one wgmma, referenced by its 32 lanes until they retire it
    unsigned short a[16][16];
    unsigned long long desc;
    int n, bf16, scale_d, refs, next_free;
};
struct WgPend {  // one wgmma in flight, as one thread sees it
    int rec;
    unsigned grp;
    float* d;
    const unsigned int* a;
    unsigned int a_copy[4];       // a's registers at issue: they must not change before the wait
    unsigned long long d_hash;    // d's bits as the wgmma will read them (see wg_hash)
};
struct WgThread {
    WgPend p[WG_MAX_PENDING];
    int np;
    unsigned cur;  // the open group's number; groups below it are committed
    int fenced;
};
struct WgState {
    WgRec* recs;
    int nrec, cap, free_head;
    WgThread* th;
    int nth;
};
EMU_SHARED_TLS WgState* tl_wg;

// The shared-memory window: region i of tl_mem->sh starts at window offset *vbase.
EMU_INTERNAL static bool wg_window(int i, unsigned long long* vbase) {
    const MemTable* t = tl_mem;
    if (!t || i >= t->nsh) return false;
    unsigned long long acc = 0;
    for (int j = 0; j <= i; j++) {
        const unsigned long long vb = ((acc + 15) & ~15ULL) + (t->sh[j].lo & 15);
        if (j == i) { *vbase = vb; return true; }
        acc = vb + t->sh[j].len;
    }
    return false;
}

EMU_INTERNAL [[noreturn]] static void wg_abort(const char* what) {
    char m[640], w[96];
    where_str(w, sizeof w);
    snprintf(m, sizeof m, "%s %s", what, w);
    abort_launch(m);
}

EMU_INTERNAL static unsigned long long wg_make_desc(const void* p, unsigned lbo, unsigned sbo) {
    const MemTable* t = tl_mem;
    const unsigned long long a = (unsigned long long)p;
    char m[400];
    int region = -1;
    for (int i = 0; t && i < t->nsh; i++)
        if (a - t->sh[i].lo < t->sh[i].len) { region = i; break; }
    if (region < 0) {
        snprintf(m, sizeof m, "wgmma descriptor: address 0x%llx is not in shared memory (B must be in a "
                 "__shared__ array or the extern __shared__ buffer)", a);
        wg_abort(m);
    }
    if (a % 16 || lbo % 16 || sbo % 16) {
        snprintf(m, sizeof m, "wgmma descriptor: start address (%% 16 = %llu), LBO %u and SBO %u bytes must be "
                 "multiples of 16 (the descriptor drops their low 4 bits)", a % 16, lbo, sbo);
        wg_abort(m);
    }
    if (lbo >= (1u << 18) || sbo >= (1u << 18)) {
        snprintf(m, sizeof m, "wgmma descriptor: LBO %u / SBO %u bytes do not fit the 14-bit fields (< 262144)",
                 lbo, sbo);
        wg_abort(m);
    }
    unsigned long long vb = 0;
    wg_window(region, &vb);
    const unsigned long long v = vb + (a - t->sh[region].lo);
    if (v >= (1ULL << 18)) wg_abort("wgmma descriptor: the block's shared memory exceeds the 256 KiB window");
    return (v >> 4) | ((unsigned long long)(lbo >> 4) << 16) | ((unsigned long long)(sbo >> 4) << 32);
}

// The host address of B's first core matrix; checks the fields and that every byte the
// wgmma reads lies in one shared array. Returns null (message in *m) on a bad descriptor.
EMU_INTERNAL static const unsigned char* wg_decode(unsigned long long desc, int n, unsigned* lbo, unsigned* sbo,
                                                   char* m, size_t mlen) {
    const unsigned long long reserved = desc & ~((0x3FFFULL) | (0x3FFFULL << 16) | (0x3FFFULL << 32) |
                                                 (7ULL << 49) | (3ULL << 62));
    if (desc >> 62) {
        snprintf(m, mlen, "wgmma descriptor 0x%016llx: swizzle mode %llu (bits 62-63); only 0 (no swizzle) is "
                 "supported", desc, desc >> 62);
        return nullptr;
    }
    if (reserved || ((desc >> 49) & 7)) {
        snprintf(m, mlen, "wgmma descriptor 0x%016llx: unused bits or the base offset (bits 49-51, no "
                 "meaning without swizzle) are set", desc);
        return nullptr;
    }
    const unsigned long long start = (desc & 0x3FFF) << 4;
    *lbo = (unsigned)(((desc >> 16) & 0x3FFF) << 4);
    *sbo = (unsigned)(((desc >> 32) & 0x3FFF) << 4);
    const MemTable* t = tl_mem;
    for (int i = 0; t && i < t->nsh; i++) {
        unsigned long long vb = 0;
        wg_window(i, &vb);
        if (start < vb || start - vb >= t->sh[i].len) continue;
        const unsigned long long off = start - vb;
        const unsigned long long end = off + (unsigned long long)(n / 8 - 1) * *sbo + *lbo + 128;
        if (end > t->sh[i].len) {
            snprintf(m, mlen, "wgmma descriptor 0x%016llx: B (n=%d, LBO %u, SBO %u) reads bytes [%llu, %llu) of "
                     "a %llu-byte shared array", desc, n, *lbo, *sbo, off, end, t->sh[i].len);
            return nullptr;
        }
        return (const unsigned char*)(t->sh[i].lo + off);
    }
    snprintf(m, mlen, "wgmma descriptor 0x%016llx: start address 0x%llx is in none of the block's shared "
             "arrays", desc, start);
    return nullptr;
}

// The accumulators' bits, hashed (FNV-1a): a write to d between a wgmma and its wait shows as
// a changed hash at the wait without keeping a copy of up to 128 registers per wgmma.
EMU_INTERNAL static unsigned long long wg_hash(const float* d, int n) {
    unsigned long long h = 0xcbf29ce484222325ULL;
    for (int i = 0; i < n; i++) {
        unsigned u;
        std::memcpy(&u, d + i, 4);
        h = (h ^ u) * 0x100000001b3ULL;
    }
    return h;
}

EMU_INTERNAL static WgState* wg_state(int nthreads) {
    WgState* s = tl_wg;
    if (!s) {
        s = (WgState*)calloc(1, sizeof(WgState));
        s->free_head = -1;
        tl_wg = s;
    }
    if (s->nth < nthreads) {
        free(s->th);
        s->th = (WgThread*)calloc((size_t)nthreads, sizeof(WgThread));
        s->nth = nthreads;
    }
    return s;
}

EMU_INTERNAL static void wg_block_start(Block* b) {
    WgState* s = tl_wg;
    if (!s) return;  // no wgmma in this module on this OS thread yet
    wg_state(b->nthreads);
    for (int i = 0; i < b->nthreads; i++) { s->th[i].np = 0; s->th[i].cur = 0; s->th[i].fenced = 0; }
    s->nrec = 0;
    s->free_head = -1;
}

EMU_INTERNAL static int wg_alloc(WgState* s) {
    if (s->free_head >= 0) {
        const int r = s->free_head;
        s->free_head = s->recs[r].next_free;
        return r;
    }
    if (s->nrec == s->cap) {
        s->cap = s->cap ? 2 * s->cap : 64;
        s->recs = (WgRec*)realloc(s->recs, (size_t)s->cap * sizeof(WgRec));
    }
    return s->nrec++;
}

EMU_INTERNAL static void resolve_wgmma(Block* b, int wi, Warp& w) {
    char m[400];
    if (b->nthreads % 128) {
        snprintf(m, sizeof m, "wgmma.mma_async in warp %d of a block of %d threads: a warpgroup is 4 whole "
                 "warps, so the block needs a multiple of 128 threads", wi, b->nthreads);
        fail(b, m);
        return;
    }
    const WgLaneArgs* l0 = (const WgLaneArgs*)(unsigned long long)w.in[0];
    for (int l = 1; l < 32; l++) {
        const WgLaneArgs* x = (const WgLaneArgs*)(unsigned long long)w.in[l];
        if (x->desc != l0->desc || x->n != l0->n || x->bf16 != l0->bf16 || (x->scale_d != 0) != (l0->scale_d != 0)) {
            snprintf(m, sizeof m, "wgmma.mma_async in warp %d: lane %d passes descriptor 0x%016llx, scale_d %d, "
                     "while lane 0 passes 0x%016llx, %d (they must agree)", wi, l, x->desc, x->scale_d,
                     l0->desc, l0->scale_d);
            fail(b, m);
            return;
        }
    }
    unsigned lbo, sbo;
    if (!wg_decode(l0->desc, l0->n, &lbo, &sbo, m, sizeof m)) { fail(b, m); return; }
    WgState* s = wg_state(b->nthreads);
    for (int l = 0; l < 32; l++) {
        const WgThread& th = s->th[wi * 32 + l];
        if (th.np == 0 && !th.fenced) {
            snprintf(m, sizeof m, "wgmma.mma_async in warp %d: thread %d issues it without a wgmma_fence() "
                     "since it last had no wgmma in flight", wi, wi * 32 + l);
            fail(b, m);
            return;
        }
        if (th.np == WG_MAX_PENDING) {
            snprintf(m, sizeof m, "wgmma.mma_async in warp %d: thread %d has %d wgmmas in flight (the "
                     "emulator's limit; wait for some)", wi, wi * 32 + l, WG_MAX_PENDING);
            fail(b, m);
            return;
        }
    }
    const int r = wg_alloc(s);
    WgRec& rec = s->recs[r];
    for (int l = 0; l < 32; l++) {
        const WgLaneArgs* x = (const WgLaneArgs*)(unsigned long long)w.in[l];
        const int g = l >> 2, t = l & 3;
        for (int i = 0; i < 8; i++) {
            const unsigned reg = x->a[i >> 1];
            rec.a[g + ((i & 2) ? 8 : 0)][t * 2 + (i & 1) + ((i & 4) ? 8 : 0)] =
                (unsigned short)((i & 1) ? reg >> 16 : reg & 0xffffu);
        }
    }
    rec.desc = l0->desc;
    rec.n = l0->n;
    rec.bf16 = l0->bf16;
    rec.scale_d = l0->scale_d != 0;
    rec.refs = 32;
    for (int l = 0; l < 32; l++) {
        WgThread& th = s->th[wi * 32 + l];
        const WgLaneArgs* x = (const WgLaneArgs*)(unsigned long long)w.in[l];
        WgPend& e = th.p[th.np++];
        e.rec = r;
        e.grp = th.cur;
        e.d = x->d;
        e.a = x->a;
        for (int i = 0; i < 4; i++) e.a_copy[i] = x->a[i];
        e.d_hash = wg_hash(x->d, l0->n / 2);
    }
    if (EMU_COUNTERS && g_counting && tl_cnt) {
        unsigned long long* o = ((Count*)tl_cnt)->out;
        o[CNT_WGMMA_MMA] += (unsigned long long)(l0->n / 8);  // this warp's m16n8k16 equivalents
        if (wi % 4 == 0) {  // once per warpgroup instruction: its first warp
            o[CNT_WGMMA]++;
            o[CNT_WGMMA_SMEM_BYTES] += 32ULL * (unsigned long long)l0->n;  // B: N x 16 x 2 bytes
        }
    }
}

// Computes thread `tid`'s accumulators of its wgmmas in groups below `limit`, oldest first.
// Its A registers and accumulators must be as the wgmma left them (on the GPU the MMA reads
// and writes them until the wait: changing them before is undefined).
EMU_INTERNAL static void wg_retire(WgState* s, int tid, unsigned limit) {
    WgThread& th = s->th[tid];
    const int g = (tid & 31) >> 2, t = tid & 3;
    int kept = 0;
    char m[400];
    for (int p = 0; p < th.np; p++) {
        WgPend& e = th.p[p];
        if (e.grp >= limit) { th.p[kept++] = e; continue; }
        WgRec& rec = s->recs[e.rec];
        for (int i = 0; i < 4; i++)
            if (e.a[i] != e.a_copy[i]) {
                snprintf(m, sizeof m, "wgmma_wait_group: a[%d] of a wgmma in flight changed from 0x%08x to 0x%08x "
                         "before the wait that retires it (the MMA reads A's registers until then)", i,
                         e.a_copy[i], e.a[i]);
                wg_abort(m);
            }
        if (wg_hash(e.d, rec.n / 2) != e.d_hash) {
            snprintf(m, sizeof m, "wgmma_wait_group: the accumulators of a wgmma in flight (n=%d) were written "
                     "before the wait that retires it (the MMA owns them until then)", rec.n);
            wg_abort(m);
        }
        unsigned lbo, sbo;
        const unsigned char* bp = wg_decode(rec.desc, rec.n, &lbo, &sbo, m, sizeof m);
        if (!bp) wg_abort(m);  // the shared arrays cannot change within a block: not reached
        const int bf = rec.bf16;
        auto elem = [bf](unsigned short h) { return bf ? bf16_bits_to_f32(h) : f16_bits_to_f32(h); };
        float* d = e.d;
        const unsigned long long before = e.d_hash;
        // This thread's two rows of A and, per column, the column of B, widened once (each
        // element is exact in double); every accumulator adds its 16 products in k order.
        double a2[2][16], bcol[16];
        for (int r = 0; r < 2; r++)
            for (int k = 0; k < 16; k++) a2[r][k] = (double)elem(rec.a[g + 8 * r][k]);
        for (int j = 0; j < rec.n / 8; j++)
            for (int c = 0; c < 2; c++) {
                const int col = 8 * j + 2 * t + c;
                for (int k = 0; k < 16; k++) {
                    unsigned short h;
                    std::memcpy(&h, bp + (col / 8) * sbo + (k / 8) * lbo + (col % 8) * 16 + (k % 8) * 2, 2);
                    bcol[k] = (double)elem(h);
                }
                for (int r = 0; r < 2; r++) {  // i = c + 2r: rows g and g + 8
                    const int i = c + 2 * r;
                    double acc = rec.scale_d ? (double)d[4 * j + i] : 0.0;
                    for (int k = 0; k < 16; k++) acc += a2[r][k] * bcol[k];
                    d[4 * j + i] = (float)acc;
                }
            }
        // Later wgmmas into the same registers, issued while this one was in flight, read them
        // as this one leaves them.
        const unsigned long long after = wg_hash(d, rec.n / 2);
        for (int q = p + 1; q < th.np; q++)
            if (th.p[q].d == d && th.p[q].d_hash == before) th.p[q].d_hash = after;
        if (--rec.refs == 0) { rec.next_free = s->free_head; s->free_head = e.rec; }
    }
    th.np = kept;
    if (kept == 0) th.fenced = 0;
}

EMU_INTERNAL static void wg_thread_exit(Block* b, Fiber* f) {
    WgState* s = tl_wg;
    if (!s || f->tid >= s->nth || !s->th[f->tid].np) return;
    const WgThread& th = s->th[f->tid];
    int open = 0;
    for (int p = 0; p < th.np; p++) open += th.p[p].grp == th.cur;
    char m[400];
    snprintf(m, sizeof m, "thread (%u,%u,%u) of block (%u,%u,%u) exits with %d wgmma(s) in flight (%d never "
             "committed): wgmma_commit_group() and wgmma_wait_group<0>() must retire every wgmma before the "
             "kernel ends", f->tidx.x, f->tidx.y, f->tidx.z, b->bidx.x, b->bidx.y, b->bidx.z, th.np, open);
    fail(b, m);
}
}  // namespace emu
