// emu_memcheck.h — part of cuda_emu.h (included by it only, after the parts before it).
// Memory checks: every load and store of kernel code against the launch's
// allocations and shared memory (byte-exact bounds), misaligned vectors.
#pragma once

// ---------------------------------------------------------------- faults

// ---------------------------------------------------------------- memory checks
// Kernel code is compiled with g++ -fsanitize=kernel-address and every load
// and store of it calls __asan_{load,store}N_noabort (in emu_launch.h; no shadow memory:
// these are ours). Each launch gets a table of the allocations its pointer
// arguments point into (from guarded_memory.py: data [d0, d1) inside a mapping
// [lo, hi) with guard pages at both ends). An access that touches a page of a
// mapping other than its interior pages is compared with [d0, d1) exactly, so
// a[-1] and a[n] are reported for any byte size; interior pages cost one hash
// probe. Vector alignment is checked by the vector types themselves (g++
// splits struct copies into scalar accesses before instrumenting them).
struct MemRange {
    unsigned long long lo, hi, d0, d1;
    const char* name;  // "`param` (device array shape=... dtype=...)"
    int arg;           // index in the launch's list of ranges (counter mode reports per range)
};
enum : int { MEM_SLOTS = 1024, MEM_MAX_RANGES = 128, JUMP_FAULT = 1, JUMP_REPORT = 2 };
struct MemTable {
    MemRange r[MEM_MAX_RANGES];
    int n;
    // This OS thread's shared memory (static and dynamic), noted before each block.
    // Under the shuffled schedule a lane may hand over to another lane of its warp
    // before any shared-memory access, so lanes interleave between warp-level
    // synchronisation points as they may on Volta and later, not only there.
    struct { unsigned long long lo, len; } sh[32];
    unsigned long long sh_lo, sh_len;  // the hull of sh[0..nsh): [sh_lo, sh_lo + sh_len)
    int nsh;
    bool yield;
    bool count;  // counter mode: tl_cnt is this launch's counting state
    unsigned long long yrng;
    unsigned long long key[MEM_SLOTS];  // page number + 1; 0 = empty slot
    int val[MEM_SLOTS];
};
EMU_SHARED_TLS MemTable* tl_mem;

EMU_INTERNAL static inline unsigned mem_slot(unsigned long long page) {
    return (unsigned)((page * 0x9e3779b97f4a7c15ULL) >> 54) & (MEM_SLOTS - 1);
}

EMU_INTERNAL static void mem_add_page(MemTable* t, unsigned long long page, int idx, int* used) {
    if (*used >= MEM_SLOTS / 2) return;  // keep probes short; an enormous table only loses coverage
    unsigned h = mem_slot(page);
    while (t->key[h]) {
        if (t->key[h] == page + 1) return;  // an allocation passed twice: the first name wins
        h = (h + 1) & (MEM_SLOTS - 1);
    }
    t->key[h] = page + 1;
    t->val[h] = idx;
    (*used)++;
}

EMU_INTERNAL static void build_mem_table(MemTable* t, const unsigned long long* ranges, const char* const* names,
                                         int nranges) {
    std::memset(t->key, 0, sizeof t->key);
    t->n = 0;
    t->nsh = 0;
    t->sh_lo = t->sh_len = 0;
    t->yield = false;
    t->count = false;
    t->yrng = 1;
    int used = 0;
    for (int i = 0; i < nranges && t->n < MEM_MAX_RANGES; i++) {
        MemRange& r = t->r[t->n];
        r.lo = ranges[4 * i];
        r.hi = ranges[4 * i + 1];
        r.d0 = ranges[4 * i + 2];
        r.d1 = ranges[4 * i + 3];
        r.name = names[i];
        r.arg = i;
        if (r.hi <= r.lo) continue;
        const int idx = t->n++;
        // Pages from the leading guard page to the first data page, and from
        // the last data page to the trailing guard page.
        for (unsigned long long p = r.lo >> 12; p <= (r.d0 >> 12) && p < (r.hi >> 12); p++) mem_add_page(t, p, idx, &used);
        const unsigned long long last = r.d1 > r.d0 ? (r.d1 - 1) >> 12 : r.d0 >> 12;
        for (unsigned long long p = last; p < (r.hi >> 12); p++) mem_add_page(t, p, idx, &used);
    }
}

EMU_SHARED_TLS sigjmp_buf* tl_fault_jmp;

// Ends the launch at once (the fiber does not run on into memory it must not touch).
EMU_INTERNAL [[noreturn]] static void abort_launch(const char* msg) {
    fail(tl_block, msg);
    sigjmp_buf* j = tl_fault_jmp;
    tl_fault_jmp = nullptr;
    siglongjmp(*j, JUMP_REPORT);
}

EMU_INTERNAL static int where_str(char* buf, size_t len) {
    const Block* b = tl_block;
    const Fiber* f = tl_fiber;
    return snprintf(buf, len, "in block (%u,%u,%u) thread (%u,%u,%u)", b->bidx.x, b->bidx.y, b->bidx.z,
                    f ? f->tidx.x : 0u, f ? f->tidx.y : 0u, f ? f->tidx.z : 0u);
}

EMU_INTERNAL [[noreturn]] static void report_oob(const MemRange& r, unsigned long long a, unsigned long long n,
                                                 bool store) {
    char m[768], w[96];
    where_str(w, sizeof w);
    const char* kind = store ? "store" : "load";
    if (a < r.d0)
        snprintf(m, sizeof m, "out-of-bounds %s of %llu bytes at 0x%llx, %llu bytes before the start of array %s "
                 "(%llu bytes) %s", kind, n, a, r.d0 - a, r.name, r.d1 - r.d0, w);
    else
        snprintf(m, sizeof m, "out-of-bounds %s of %llu bytes at 0x%llx, %llu bytes past the end of array %s "
                 "(%llu bytes, access at byte offset %llu) %s", kind, n, a, a >= r.d1 ? a - r.d1 : 0ULL, r.name,
                 r.d1 - r.d0, a - r.d0, w);
    abort_launch(m);
}

EMU_INTERNAL static inline void check_page(const MemTable* t, unsigned long long page, unsigned long long a,
                                           unsigned long long n, bool store) {
    unsigned h = mem_slot(page);
    for (;;) {
        const unsigned long long k = t->key[h];
        if (!k) return;
        if (k == page + 1) {
            const MemRange& r = t->r[t->val[h]];
            if (a < r.d0 || a + n > r.d1) report_oob(r, a, n, store);
            return;
        }
        h = (h + 1) & (MEM_SLOTS - 1);
    }
}

// Each lane hands over once per interval between synchronisation points, at
// a random one of its first shared-memory accesses there (one of the first 8
// or, half the time, of the first 64): one extra fiber switch per lane and
// interval at most, which keeps the cost bounded in kernels that stage
// whole tiles in shared memory.
EMU_INTERNAL static void arm_yield(Fiber* f) { f->yield_in = -2; }  // drawn at the first shared access

EMU_INTERNAL static void shared_yield(MemTable* t) {
    Fiber* f = tl_fiber;
    if (!f || f->state != RUNNABLE) return;
    if (f->yield_in == -2) {
        unsigned long long x = t->yrng;  // xorshift64
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        t->yrng = x;
        f->yield_in = (x & 1) ? (int)((x >> 1) & 7) : (int)((x >> 4) & 63);
    }
    if (f->yield_in >= 0 && f->yield_in-- == 0) switch_to_scheduler();
}

EMU_INTERNAL static inline void check_access(unsigned long long a, unsigned long long n, bool store) {
    MemTable* t = tl_mem;
    const Fiber* f = tl_fiber;  // read beside tl_mem: one lookup of this module's TLS block for both
    if (!t || !n) return;
    // A scalar load or store of 2, 4 or 8 bytes (16: a 128-bit integer) must be aligned to its
    // size: the GPU faults ("misaligned address") on e.g. a 4-byte load through
    // reinterpret_cast<const unsigned int*> at an address that is 2 mod 4, which the CPU runs
    // silently. (Vector types check their own alignment when they are copied, emu_language.h.)
    if ((n == 2 || n == 4 || n == 8 || n == 16) && (a & (n - 1))) misaligned((const void*)a, (unsigned)n, "scalar", store);
    check_page(t, a >> 12, a, n, store);
    if ((a & 4095) + n > 4096) check_page(t, (a + n - 1) >> 12, a, n, store);
    // The yield below is a no-op for a lane that has already handed over in this interval
    // (yield_in == -1) or is not running: skip the scan of the shared regions then (the same
    // schedule, the same draws). Otherwise an address outside the regions' hull is global memory.
    if (t->yield) {
        if (!f || f->state != RUNNABLE || f->yield_in == -1) return;
        if (a - t->sh_lo >= t->sh_len) return;
        for (int i = 0; i < t->nsh; i++)
            if (a - t->sh[i].lo < t->sh[i].len) { shared_yield(t); break; }
    }
}

// Called by the generated poison function for each shared-memory region of this OS thread.
EMU_INTERNAL static void note_shared(const void* p, unsigned long long n) {
    MemTable* t = tl_mem;
    if (t && n && t->nsh < 32) {
        t->sh[t->nsh].lo = (unsigned long long)p;
        t->sh[t->nsh].len = n;
        t->nsh++;
        const unsigned long long lo = (unsigned long long)p, hi = lo + n;
        const unsigned long long hlo = t->sh_len && t->sh_lo < lo ? t->sh_lo : lo;
        const unsigned long long hhi = t->sh_len && t->sh_lo + t->sh_len > hi ? t->sh_lo + t->sh_len : hi;
        t->sh_lo = hlo;
        t->sh_len = hhi - hlo;
    }
}

EMU_INTERNAL static inline void misaligned(const void* p, unsigned align, const char* type, bool store) {
    if (!tl_block || !tl_mem) return;  // not inside a launch
    const unsigned long long a = (unsigned long long)p;
    const char* in = "shared or local memory";
    for (int i = 0; i < tl_mem->n; i++)
        if (a >= tl_mem->r[i].lo && a < tl_mem->r[i].hi) { in = tl_mem->r[i].name; break; }
    char m[768], w[96];
    where_str(w, sizeof w);
    snprintf(m, sizeof m, "misaligned %u-byte %s %s at 0x%llx (address %% %u = %llu) in %s %s", align, type,
             store ? "store" : "load", a, align, a % align, in, w);
    abort_launch(m);
}

// ldmatrix (cuda_src/ldmatrix.cuh): a lane's row address is 16-byte aligned and names 16 bytes
// of this block's shared memory (static or dynamic).
EMU_INTERNAL static void check_ldmatrix_row(const void* row) {
    const MemTable* t = tl_mem;
    if (!tl_block || !t) return;  // not inside a launch
    const unsigned long long a = (unsigned long long)row;
    char m[512], w[96];
    if (a & 15) {
        where_str(w, sizeof w);
        snprintf(m, sizeof m, "ldmatrix: row address 0x%llx is not 16-byte aligned (address %% 16 = %llu) %s", a,
                 a % 16, w);
        abort_launch(m);
    }
    for (int i = 0; i < t->nsh; i++)
        if (a >= t->sh[i].lo && a + 16 <= t->sh[i].lo + t->sh[i].len) return;
    const char* in = "memory that is not this block's shared memory";
    for (int i = 0; i < t->n; i++)
        if (a >= t->r[i].lo && a < t->r[i].hi) { in = t->r[i].name; break; }
    where_str(w, sizeof w);
    snprintf(m, sizeof m, "ldmatrix: row address 0x%llx is not in shared memory (the 16-byte row lies in %s) %s", a,
             in, w);
    abort_launch(m);
}
