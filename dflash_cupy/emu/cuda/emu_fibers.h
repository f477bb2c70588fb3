// emu_fibers.h — part of cuda_emu.h (included by it only, after the parts before it).
// Fibers and scheduling: a block's threads as user-space fibers on one OS
// thread, barriers, warp collectives (shuffles, votes, mma.sync), deadlock reports.
#pragma once

// ---------------------------------------------------------------- fibers
// The emulator's own machinery is not instrumented by the memory checks
// (g++ -fsanitize=kernel-address, see emu_memcheck.h): only kernel code is.
#define EMU_INTERNAL __attribute__((no_sanitize_address))

namespace emu {

enum : int { RUNNABLE = 0, AT_BARRIER = 1, AT_WARP = 2, DONE = 3 };
enum : int { OP_SYNCWARP = 1, OP_SHFL_IDX, OP_SHFL_UP, OP_SHFL_DOWN, OP_SHFL_XOR, OP_BALLOT, OP_ANY, OP_ALL,
             OP_MMA_F16, OP_MMA_BF16, OP_WGMMA };
enum : int { ORDER_FORWARD = 0, ORDER_REVERSE = 1, ORDER_SHUFFLE = 2 };

static const char* const op_names[] = {"?", "__syncwarp", "__shfl_sync", "__shfl_up_sync", "__shfl_down_sync",
                                       "__shfl_xor_sync", "__ballot_sync", "__any_sync", "__all_sync",
                                       "mma.sync.m16n8k16 (f16)", "mma.sync.m16n8k16 (bf16)",
                                       "wgmma.mma_async"};

struct Fiber {
    void* sp;
    char* stack;  // usable stack (a PROT_NONE guard page lies just below)
    uint3 tidx;
    int tid;
    int state;
    int bar_result;
    int yield_in;  // shared-memory accesses before this lane hands over (-1: not again in this
                   // interval; -2: not drawn yet)
    unsigned long long warp_result;
    // Counter mode: the bytes of this lane's latest vector load [0] / store [1]
    // whose pieces (g++'s split copy) are still to come and are not counted
    // again, and ldmatrix's gathers (counted as the one instruction they are).
    unsigned long long cv_lo[2], cv_hi[2], cv_left[2];
    int cnt_mute;
    int pdl_waited;  // counter mode: this thread has run pdl_wait() (pdl.cuh)
#if !defined(__x86_64__)
    ucontext_t uc;
#endif
};

// A warp's lanes waiting at collectives. As on Volta and later, each lane
// names the lanes it synchronises with (its mask); several disjoint groups of
// one warp may wait at once, and a group completes when every non-exited
// lane of its mask has arrived at the same collective with the same mask.
struct Warp {
    unsigned exited;   // exited lanes, and lanes past the end of the block
    unsigned waiting;  // lanes at a collective
    // While every waiting lane waits at one op with one mask (the common case)
    // an arriving lane with the same op and mask needs no pairwise checks.
    bool uniform;
    int u_op;
    unsigned u_mask;
    unsigned mask[32];
    int op[32];
    unsigned long long in[32];
    int arg[32], width[32];
};

struct Block {
    uint3 bidx;
    uint3 bdim, gdim;
    int nthreads, live, bar_arrived, bar_count;
    Fiber* fibers;
    Warp* warps;
    void* sched_sp;
#if !defined(__x86_64__)
    ucontext_t sched_uc;
#endif
    void (*body)(void**);
    void** args;
    char* err;
    int errlen;
    bool failed;
    bool pdl_waited;  // counter mode: some thread of the block has run pdl_wait()
};

EMU_SHARED_TLS Fiber* tl_fiber;
EMU_SHARED_TLS Block* tl_block;

#ifndef EMU_STACK_BYTES
#define EMU_STACK_BYTES 65536  // the launcher generator defines it from emu_build.STACK_BYTES
#endif
static const size_t STACK_BYTES = EMU_STACK_BYTES;

#if defined(__x86_64__)
// Saves callee-saved registers, MXCSR and the x87 control word on the old
// stack, switches stacks and restores the same from the new one.
extern "C" __attribute__((visibility("hidden"))) void emu_ctx_switch(void** save_sp, void* new_sp);
#if EMU_RT_DEFINE
asm(".text\n"
    ".p2align 4\n"
    ".globl emu_ctx_switch\n"
    ".hidden emu_ctx_switch\n"
    ".type emu_ctx_switch,@function\n"
    "emu_ctx_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  subq $8, %rsp\n  stmxcsr (%rsp)\n  fnstcw 4(%rsp)\n"
    "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
    "  ldmxcsr (%rsp)\n  fldcw 4(%rsp)\n  addq $8, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
    "  ret\n"
    ".size emu_ctx_switch, .-emu_ctx_switch\n");
#endif  // EMU_RT_DEFINE
#endif

static void fiber_main();

// Fiber stacks come from the caller (the Python side keeps one arena per OS
// thread, shared by every module): STACK_BYTES each, a PROT_NONE guard page
// below each one, so a stack overflow faults instead of corrupting.
struct StackArena {
    char* base;
    int count;
    size_t stride;  // guard page + STACK_BYTES
    EMU_INTERNAL char* get(int i) const { return i < count ? base + (size_t)i * stride + (stride - STACK_BYTES) : nullptr; }
};

static inline void switch_to_scheduler() {
    Fiber* f = tl_fiber;
    Block* b = tl_block;
#if defined(__x86_64__)
    emu_ctx_switch(&f->sp, b->sched_sp);
#else
    swapcontext(&f->uc, &b->sched_uc);
#endif
}

static inline void switch_to_fiber(Block* b, Fiber* f) {
    tl_fiber = f;
#if defined(__x86_64__)
    emu_ctx_switch(&b->sched_sp, f->sp);
#else
    swapcontext(&b->sched_uc, &f->uc);
#endif
}

EMU_INTERNAL static inline void init_fiber(Fiber* f) {
#if defined(__x86_64__)
    // Frame popped by emu_ctx_switch: [mxcsr|fpucw][r15..rbp][ret=fiber_main].
    // After its `ret`, rsp % 16 == 8, as at the entry of a called function.
    unsigned long long* top = (unsigned long long*)(f->stack + STACK_BYTES);
    unsigned long long* sp = top - 9;
    const unsigned int mxcsr = 0x1f80u | 0x8000u | 0x0040u;  // all masked, FTZ, DAZ
    sp[0] = (unsigned long long)mxcsr | (0x037fULL << 32);
    for (int i = 1; i <= 6; i++) sp[i] = 0;
    sp[7] = (unsigned long long)(void*)&fiber_main;
    sp[8] = 0;
    f->sp = sp;
#else
    getcontext(&f->uc);
    f->uc.uc_stack.ss_sp = f->stack;
    f->uc.uc_stack.ss_size = STACK_BYTES;
    f->uc.uc_link = nullptr;
    makecontext(&f->uc, (void (*)())fiber_main, 0);
#endif
}

EMU_INTERNAL static void arm_yield(Fiber* f);
EMU_INTERNAL static void count_barrier();
EMU_INTERNAL static void count_mma();

EMU_INTERNAL static inline void release_barrier(Block* b) {
    if (EMU_COUNTERS && g_counting && tl_cnt) count_barrier();
    for (int i = 0; i < b->nthreads; i++) {
        Fiber* f = &b->fibers[i];
        if (f->state == AT_BARRIER) { f->state = RUNNABLE; f->bar_result = b->bar_count; arm_yield(f); }
    }
    b->bar_arrived = 0;
    b->bar_count = 0;
}

// A lane outside the group reads its own value, as for a source outside the segment.
EMU_INTERNAL static inline unsigned long long lane_value(const Warp& w, unsigned group, int lane, int src) {
    return (src >= 0 && src < 32 && ((group >> src) & 1u)) ? w.in[src] : w.in[lane];
}

// One lane's operands of mma.sync.m16n8k16.row.col.f32.{f16,bf16}: registers as
// in the PTX ISA ("Matrix Fragments for mma.m16n8k16 with floating point type").
struct MmaLane {
    float* d;
    const unsigned int* a;  // 4 registers, 2 elements each (low half first)
    const unsigned int* b;  // 2 registers
    const float* c;         // 4 accumulators
};

// D = A(16x16) * B(16x8) + C with every lane's fragment gathered, products and
// sums in double and one rounding to f32 (the hardware's f32 accumulation
// differs in the last bits; tests compare with tolerances).
EMU_INTERNAL static inline void resolve_mma(Warp& w, bool bf16) {
    float mma_a[16][16], mma_b[16][8], mma_c[16][8];  // (names clear of kernels' -D macros)
    auto elem = [bf16](unsigned int reg, int hi) {
        unsigned short h = (unsigned short)(hi ? reg >> 16 : reg & 0xffffu);
        return bf16 ? bf16_bits_to_f32(h) : f16_bits_to_f32(h);
    };
    for (int l = 0; l < 32; l++) {
        const MmaLane* m = (const MmaLane*)(unsigned long long)w.in[l];
        const int g = l >> 2, t = l & 3;
        for (int i = 0; i < 8; i++) {
            const int row = g + ((i & 2) ? 8 : 0), col = t * 2 + (i & 1) + ((i & 4) ? 8 : 0);
            mma_a[row][col] = elem(m->a[i >> 1], i & 1);
        }
        for (int i = 0; i < 4; i++) mma_b[t * 2 + (i & 1) + ((i & 2) ? 8 : 0)][g] = elem(m->b[i >> 1], i & 1);
        for (int i = 0; i < 4; i++) mma_c[g + ((i & 2) ? 8 : 0)][t * 2 + (i & 1)] = m->c[i];
    }
    float mma_d[16][8];
    for (int r = 0; r < 16; r++)
        for (int n = 0; n < 8; n++) {
            double acc = mma_c[r][n];
            for (int k = 0; k < 16; k++) acc += (double)mma_a[r][k] * (double)mma_b[k][n];
            mma_d[r][n] = (float)acc;
        }
    for (int l = 0; l < 32; l++) {
        const MmaLane* m = (const MmaLane*)(unsigned long long)w.in[l];
        const int g = l >> 2, t = l & 3;
        for (int i = 0; i < 4; i++) m->d[i] = mma_d[g + ((i & 2) ? 8 : 0)][t * 2 + (i & 1)];
    }
}

static inline void fail(Block* b, const char* msg);
// wgmma (emu_tensor_core.h): issue at the warp collective, per-thread state at a
// block's start and a thread's exit.
EMU_INTERNAL static void resolve_wgmma(Block* b, int wi, Warp& w);
EMU_INTERNAL static void wg_block_start(Block* b);
EMU_INTERNAL static void wg_thread_exit(Block* b, Fiber* f);

// Completes the collective of the lanes in `group` (all waiting with the same op and mask).
EMU_INTERNAL static void resolve_group(Block* b, int wi, unsigned group) {
    Warp& w = b->warps[wi];
    const int l0 = __builtin_ctz(group);
    const int op = w.op[l0];
    if (op == OP_MMA_F16 || op == OP_MMA_BF16) {
        if (group != 0xffffffffu) {
            char m[160];
            snprintf(m, sizeof m, "%s in warp %d with lanes 0x%08x: it needs all 32", op_names[op], wi, group);
            fail(b, m);
        } else {
            resolve_mma(w, op == OP_MMA_BF16);
            if (EMU_COUNTERS && g_counting && tl_cnt) count_mma();
        }
    }
    if (op == OP_WGMMA) {
        if (group != 0xffffffffu) {
            char m[160];
            snprintf(m, sizeof m, "%s in warp %d with lanes 0x%08x: it needs all 32", op_names[op], wi, group);
            fail(b, m);
        } else {
            resolve_wgmma(b, wi, w);
        }
    }
    unsigned vote = 0;
    for (int l = 0; l < 32; l++)
        if (((group >> l) & 1u) && w.in[l] != 0) vote |= 1u << l;
    for (int l = 0; l < 32; l++) {
        if (!((group >> l) & 1u)) continue;
        Fiber* f = &b->fibers[wi * 32 + l];
        int width = w.width[l], arg = w.arg[l];
        int seg = l & ~(width - 1), src;
        unsigned long long r = 0;
        switch (op) {
            case OP_SHFL_IDX: src = seg + (arg & (width - 1)); r = lane_value(w, group, l, src); break;
            case OP_SHFL_UP: src = l - arg; r = (src < seg) ? w.in[l] : lane_value(w, group, l, src); break;
            case OP_SHFL_DOWN: src = l + arg; r = (src >= seg + width) ? w.in[l] : lane_value(w, group, l, src); break;
            case OP_SHFL_XOR: src = l ^ arg; r = (src >= seg + width) ? w.in[l] : lane_value(w, group, l, src); break;
            case OP_BALLOT: r = vote; break;
            case OP_ANY: r = vote != 0; break;
            case OP_ALL: r = vote == group; break;
            default: r = 0; break;
        }
        f->warp_result = r;
        f->state = RUNNABLE;
        arm_yield(f);
    }
    w.waiting &= ~group;
}

// Resolves the group named by `mask` if all its non-exited lanes wait with that mask.
EMU_INTERNAL static void try_resolve(Block* b, int wi, unsigned mask) {
    Warp& w = b->warps[wi];
    const unsigned need = mask & ~w.exited;
    if (!need || (w.waiting & need) != need) return;
    const int l0 = __builtin_ctz(need);
    for (unsigned m = w.uniform ? 0u : need; m; m &= m - 1) {
        const int l = __builtin_ctz(m);
        if (w.mask[l] != mask || w.op[l] != w.op[l0]) return;
    }
    resolve_group(b, wi, need);
}

static inline void fail(Block* b, const char* msg) {
    if (!b->failed) {
        b->failed = true;
        snprintf(b->err, (size_t)b->errlen, "%s", msg);
    }
}

EMU_RT unsigned long long warp_collective(int op, unsigned long long v, int arg, int width, unsigned mask)
#if !EMU_RT_DEFINE
    ;
#else
{
    Block* b = tl_block;
    Fiber* f = tl_fiber;
    int wi = f->tid >> 5, lane = f->tid & 31;
    Warp& w = b->warps[wi];
    if (width <= 0 || width > 32 || (width & (width - 1))) {
        char m[160];
        snprintf(m, sizeof m, "%s: width %d is not a power of two in [1, 32] (thread %d)", op_names[op], width, f->tid);
        fail(b, m);
        width = 32;
    }
    if (!((mask >> lane) & 1u)) {
        char m[200];
        snprintf(m, sizeof m, "%s in warp %d: lane %d (thread %d) passes mask 0x%08x, which leaves the lane itself out",
                 op_names[op], wi, lane, f->tid, mask);
        fail(b, m);
        mask |= 1u << lane;
    }
    const bool same = w.waiting == 0 || (w.uniform && w.u_op == op && w.u_mask == mask);
    if (w.waiting == 0) { w.uniform = true; w.u_op = op; w.u_mask = mask; }
    else if (!same) w.uniform = false;
    // Two lanes that each name the other but wait at different collectives or
    // with different masks wait for each other forever (undefined in PTX).
    for (unsigned m = same ? 0u : w.waiting & mask; m; m &= m - 1) {
        const int j = __builtin_ctz(m);
        if (!((w.mask[j] >> lane) & 1u)) continue;
        if (w.op[j] != op) {
            char msg[240];
            snprintf(msg, sizeof msg, "divergent warp collectives in warp %d: lane %d waits at %s while lane %d "
                     "reached %s", wi, j, op_names[w.op[j]], lane, op_names[op]);
            fail(b, msg);
        } else if (w.mask[j] != mask) {
            char msg[240];
            snprintf(msg, sizeof msg, "%s in warp %d: lane %d passes mask 0x%08x but lane %d passes 0x%08x "
                     "(the lanes of one collective must name the same mask)", op_names[op], wi, j, w.mask[j],
                     lane, mask);
            fail(b, msg);
        }
    }
    w.in[lane] = v;
    w.arg[lane] = arg;
    w.width[lane] = width;
    w.op[lane] = op;
    w.mask[lane] = mask;
    w.waiting |= 1u << lane;
    f->state = AT_WARP;
    try_resolve(b, wi, mask);
    switch_to_scheduler();
    return f->warp_result;
}
#endif  // EMU_RT_DEFINE

// A lane's exit may complete groups that were waiting for it.
EMU_INTERNAL static void lane_exited(Block* b, int tid) {
    Warp& w = b->warps[tid >> 5];
    w.exited |= 1u << (tid & 31);
    for (unsigned m = w.waiting; m; m &= m - 1) {
        const int l = __builtin_ctz(m);
        if ((w.waiting >> l) & 1u) try_resolve(b, tid >> 5, w.mask[l]);
    }
}

EMU_INTERNAL static void fiber_main() {
    Block* b = tl_block;
    b->body(b->args);
    Fiber* f = tl_fiber;
    wg_thread_exit(b, f);
    f->state = DONE;
    b->live--;
    lane_exited(b, f->tid);
    if (b->bar_arrived > 0 && b->bar_arrived == b->live) release_barrier(b);
    switch_to_scheduler();
    __builtin_unreachable();
}

struct Rng {  // splitmix64: tiny, seedable, identical everywhere
    unsigned long long s;
    EMU_INTERNAL unsigned long long next() {
        unsigned long long z = (s += 0x9e3779b97f4a7c15ULL);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
        return z ^ (z >> 31);
    }
};

EMU_INTERNAL static void describe_deadlock(Block* b) {
    char msg[768];
    int n = snprintf(msg, sizeof msg,
                     "deadlock in block (%u,%u,%u): %d of %d threads still live and none can proceed;",
                     b->bidx.x, b->bidx.y, b->bidx.z, b->live, b->nthreads);
    int at_bar = 0, first_bar = -1;
    for (int i = 0; i < b->nthreads; i++)
        if (b->fibers[i].state == AT_BARRIER) { if (first_bar < 0) first_bar = i; at_bar++; }
    if (at_bar) n += snprintf(msg + n, sizeof msg - n, " %d wait at __syncthreads (first: thread %d);", at_bar, first_bar);
    int nw = (b->nthreads + 31) / 32;
    for (int wi = 0; wi < nw && n < (int)sizeof msg - 96; wi++) {
        Warp& w = b->warps[wi];
        if (w.waiting) {
            const int l = __builtin_ctz(w.waiting);
            n += snprintf(msg + n, sizeof msg - n, " warp %d: lanes 0x%08x wait (lane %d at %s, mask 0x%08x);", wi,
                          w.waiting, l, op_names[w.op[l]], w.mask[l]);
        }
    }
    snprintf(msg + n, sizeof msg - n, " (a barrier or warp collective in divergent code?)");
    fail(b, msg);
}

EMU_INTERNAL static void order_list(int* v, int n, int order, Rng& rng) {
    if (order == ORDER_REVERSE) {
        for (int i = 0, j = n - 1; i < j; i++, j--) { const int t = v[i]; v[i] = v[j]; v[j] = t; }
    } else if (order == ORDER_SHUFFLE) {
        for (int i = n; i > 1; i--) {
            const int j = (int)(rng.next() % (unsigned)i), t = v[i - 1];
            v[i - 1] = v[j];
            v[j] = t;
        }
    }
}

// Runs one block; false on deadlock or misuse (message in b->err).
EMU_INTERNAL static bool run_block(Block* b, int order, Rng& rng, const StackArena& stacks) {
    const int nt = b->nthreads, nw = (nt + 31) / 32;
    b->pdl_waited = false;
    for (int i = 0; i < nt; i++) {
        Fiber* f = &b->fibers[i];
        f->tid = i;
        f->tidx.x = (unsigned)i % b->bdim.x;
        f->tidx.y = ((unsigned)i / b->bdim.x) % b->bdim.y;
        f->tidx.z = (unsigned)i / (b->bdim.x * b->bdim.y);
        f->state = RUNNABLE;
        arm_yield(f);
        f->cv_left[0] = f->cv_left[1] = 0;
        f->cnt_mute = 0;
        f->pdl_waited = 0;
        f->stack = stacks.get(i);
        if (!f->stack) { fail(b, "the fiber stack arena is smaller than the block"); return false; }
        init_fiber(f);
    }
    for (int wi = 0; wi < nw; wi++) {
        Warp& w = b->warps[wi];
        const int nl = nt - wi * 32 < 32 ? nt - wi * 32 : 32;
        w.exited = nl == 32 ? 0u : ~((1u << nl) - 1u);
        w.waiting = 0;
        w.uniform = true;
    }
    b->live = nt;
    b->bar_arrived = b->bar_count = 0;
    wg_block_start(b);
    // Warps run one at a time, each as far as it can get (through its warp
    // collectives, up to a __syncthreads or its end) before the next warp
    // starts, in forward, reverse or shuffled warp order: one warp runs ahead
    // of the others by a whole barrier interval, the worst case for a missing
    // __syncthreads between warps. Lanes inside a warp resume in the same
    // kind of order, so a missing __syncwarp shows too.
    // (Plain arrays and loops: library templates would not inline into this
    // uninstrumented code and would run instrumented, out of line.)
    int warp_order[32], lane_order[32];  // a block has at most 1024 threads
    while (b->live > 0) {
        int nwo = 0;
        for (int wi = 0; wi < nw; wi++) {
            const int l1 = nt < wi * 32 + 32 ? nt : wi * 32 + 32;
            for (int i = wi * 32; i < l1; i++)
                if (b->fibers[i].state == RUNNABLE) { warp_order[nwo++] = wi; break; }
        }
        if (nwo == 0) { describe_deadlock(b); return false; }
        order_list(warp_order, nwo, order, rng);
        for (int k = 0; k < nwo; k++) {
            const int wi = warp_order[k];
            const int l0 = wi * 32, l1 = nt < wi * 32 + 32 ? nt : wi * 32 + 32;
            for (;;) {
                int nlo = 0;
                for (int i = l0; i < l1; i++)
                    if (b->fibers[i].state == RUNNABLE) lane_order[nlo++] = i;
                if (nlo == 0) break;
                order_list(lane_order, nlo, order, rng);
                for (int j = 0; j < nlo; j++) {
                    Fiber* f = &b->fibers[lane_order[j]];
                    if (f->state != RUNNABLE) continue;
                    switch_to_fiber(b, f);
                    if (b->failed) return false;
                }
            }
        }
    }
    return true;
}
