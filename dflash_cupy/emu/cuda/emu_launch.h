// emu_launch.h — part of cuda_emu.h (included by it only, after the parts before it).
// Launching: the sanitizer entry points of kernel code, the fault handler,
// the block runner and the extern "C" launch entry points the Python side calls.
#pragma once

#if EMU_RT_DEFINE  // the memory checks' entry points: in the runtime object only
#define EMU_ASAN_CB(EmuN) \
    extern "C" __attribute__((visibility("hidden"))) EMU_INTERNAL void __asan_load##EmuN##_noabort(void* p) { \
        ::emu::check_access((unsigned long long)p, EmuN, false); \
        if (EMU_COUNTERS && ::emu::tl_mem && ::emu::tl_mem->count) \
            ::emu::count_access((unsigned long long)p, EmuN, false, (unsigned long long)__builtin_return_address(0)); } \
    extern "C" __attribute__((visibility("hidden"))) EMU_INTERNAL void __asan_store##EmuN##_noabort(void* p) { \
        ::emu::check_access((unsigned long long)p, EmuN, true); \
        if (EMU_COUNTERS && ::emu::tl_mem && ::emu::tl_mem->count) \
            ::emu::count_access((unsigned long long)p, EmuN, true, (unsigned long long)__builtin_return_address(0)); }
EMU_ASAN_CB(1) EMU_ASAN_CB(2) EMU_ASAN_CB(4) EMU_ASAN_CB(8) EMU_ASAN_CB(16)
#undef EMU_ASAN_CB
extern "C" __attribute__((visibility("hidden"))) EMU_INTERNAL void __asan_loadN_noabort(void* p, long n) {
    ::emu::check_access((unsigned long long)p, (unsigned long long)n, false);
    if (EMU_COUNTERS && ::emu::tl_mem && ::emu::tl_mem->count)
        ::emu::count_access((unsigned long long)p, (unsigned long long)n, false,
                            (unsigned long long)__builtin_return_address(0));
}
extern "C" __attribute__((visibility("hidden"))) EMU_INTERNAL void __asan_storeN_noabort(void* p, long n) {
    ::emu::check_access((unsigned long long)p, (unsigned long long)n, true);
    if (EMU_COUNTERS && ::emu::tl_mem && ::emu::tl_mem->count)
        ::emu::count_access((unsigned long long)p, (unsigned long long)n, true,
                            (unsigned long long)__builtin_return_address(0));
}
extern "C" __attribute__((visibility("hidden"))) EMU_INTERNAL void __asan_handle_no_return() {}
#endif  // EMU_RT_DEFINE

namespace emu {
static thread_local void* tl_fault_addr;
static thread_local int tl_fault_sig;
static struct sigaction old_actions[3];
static const int fault_sigs[3] = {SIGSEGV, SIGBUS, SIGFPE};

EMU_INTERNAL static void fault_handler(int sig, siginfo_t* si, void* ctx) {
    sigjmp_buf* j = tl_fault_jmp;
    if (j) {
        tl_fault_jmp = nullptr;
        tl_fault_addr = si->si_addr;
        tl_fault_sig = sig;
        siglongjmp(*j, JUMP_FAULT);
    }
    // Not ours: hand over to whoever was installed before (Python's faulthandler, default).
    for (int i = 0; i < 3; i++) {
        if (fault_sigs[i] != sig) continue;
        struct sigaction* o = &old_actions[i];
        if ((o->sa_flags & SA_SIGINFO) && o->sa_sigaction) { o->sa_sigaction(sig, si, ctx); return; }
        if (o->sa_handler != SIG_DFL && o->sa_handler != SIG_IGN) { o->sa_handler(sig); return; }
        sigaction(sig, o, nullptr);  // default action when the faulting instruction re-executes
    }
}

EMU_INTERNAL static void install_fault_handlers() {
    static std::atomic<bool> installed(false);
    bool expected = false;
    if (installed.compare_exchange_strong(expected, true)) {
        for (int i = 0; i < 3; i++) {
            struct sigaction sa;
            std::memset(&sa, 0, sizeof sa);
            sa.sa_sigaction = fault_handler;
            sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
            sigemptyset(&sa.sa_mask);
            sigaction(fault_sigs[i], &sa, &old_actions[i]);
        }
    }
    static thread_local bool alt_done = false;
    if (!alt_done) {  // a fiber stack overflow needs somewhere else to run the handler
        static thread_local char* alt = nullptr;
        const size_t sz = 64 * 1024;
        alt = (char*)mmap(nullptr, sz, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        stack_t ss;
        ss.ss_sp = alt;
        ss.ss_size = sz;
        ss.ss_flags = 0;
        sigaltstack(&ss, nullptr);
        alt_done = true;
    }
}

struct LaunchResult {
    int status;  // 0 ok, 1 error message, 2 fault
    void* fault_addr;
    int fault_sig;
};

// Runs blocks [first, grid_total) with stride `stride` on the calling OS thread.
EMU_INTERNAL static void run_blocks(void (*body)(void**), void** args, const unsigned* grid, const unsigned* block,
                       void (*poison)(unsigned), unsigned shmem, unsigned long long seed, int order,
                       unsigned long long first, unsigned long long stride, const StackArena& stacks,
                       const unsigned long long* ranges, const char* const* names, int nranges,
                       char* err, int errlen, LaunchResult* res,
                       const unsigned long long* ids = nullptr, unsigned long long n_ids = 0,
                       Count* cnt = nullptr) {
    install_fault_handlers();
    const int nt = (int)(block[0] * block[1] * block[2]);
    std::vector<Fiber> fibers((size_t)nt);
    std::vector<Warp> warps((size_t)((nt + 31) / 32));
    Block b;
    std::memset(&b, 0, sizeof b);
    b.bdim = make_uint3(block[0], block[1], block[2]);
    b.gdim = make_uint3(grid[0], grid[1], grid[2]);
    b.nthreads = nt;
    b.fibers = fibers.data();
    b.warps = warps.data();
    b.body = body;
    b.args = args;
    b.err = err;
    b.errlen = errlen;
    const unsigned long long total = (unsigned long long)grid[0] * grid[1] * grid[2];
    sigjmp_buf jb;
    volatile unsigned long long cur = first;
    MemTable mem;
    build_mem_table(&mem, ranges, names, nranges);
    const int jumped = sigsetjmp(jb, 1);
    if (jumped) {
        tl_mem = nullptr;
        tl_cnt = nullptr;
        if (jumped == JUMP_REPORT) {  // a memory check failed; the message is in err
            res->status = 1;
        } else {
            res->status = 2;
            res->fault_addr = tl_fault_addr;
            res->fault_sig = tl_fault_sig;
            unsigned long long c = cur;
            int n = snprintf(err, (size_t)errlen, "block (%llu,%llu,%llu)", c % grid[0], (c / grid[0]) % grid[1],
                             c / ((unsigned long long)grid[0] * grid[1]));
            if (tl_fiber && n < errlen)
                snprintf(err + n, (size_t)(errlen - n), " thread (%u,%u,%u)", tl_fiber->tidx.x, tl_fiber->tidx.y,
                         tl_fiber->tidx.z);
        }
        tl_block = nullptr;
        tl_fiber = nullptr;
        return;
    }
    tl_mem = &mem;
    tl_fault_jmp = &jb;
    tl_block = &b;
    mem.count = cnt != nullptr;
    tl_cnt = cnt;
    // A list of blocks (counter mode's sample) or first, first + stride, ...
    const unsigned long long end = ids ? n_ids : total, step = ids ? 1 : stride;
    for (unsigned long long j = ids ? 0 : first; j < end; j += step) {
        const unsigned long long i = ids ? ids[j] : j;
        cur = i;
        b.bidx.x = (unsigned)(i % grid[0]);
        b.bidx.y = (unsigned)((i / grid[0]) % grid[1]);
        b.bidx.z = (unsigned)(i / ((unsigned long long)grid[0] * grid[1]));
        Rng rng{seed ^ (0x9e3779b97f4a7c15ULL * (i + 1))};
        mem.nsh = 0;
        mem.sh_len = 0;
        mem.yield = order == ORDER_SHUFFLE;
        mem.yrng = rng.next() | 1;
        if (poison) poison(shmem);
        if (!run_block(&b, order, rng, stacks)) { res->status = 1; break; }
        if (cnt) {
            cnt_flush(cnt);
            cnt->out[CNT_BLOCKS]++;
            if (b.pdl_waited) cnt->out[CNT_PDL_WAITED_BLOCKS]++;
        }
    }
    tl_fault_jmp = nullptr;
    tl_cnt = nullptr;
    tl_mem = nullptr;
    tl_block = nullptr;
    tl_fiber = nullptr;
}

// Runs blocks first, first+stride, ... of a launch on the calling OS thread;
// the Python side spreads a launch over its persistent worker threads, each
// with its own stack arena (shared memory is per OS thread too).
EMU_RT int launch(void (*body)(void**), void** args, const unsigned* grid, const unsigned* block,
                  void (*poison)(unsigned), unsigned shmem, unsigned long long seed, int order,
                  unsigned long long first, unsigned long long stride, void* stack_base, int stack_count,
                  unsigned long long stack_stride, const unsigned long long* ranges, const char* const* names,
                  int nranges, char* err, int errlen, void** fault_addr, int* fault_sig)
#if !EMU_RT_DEFINE
    ;
#else
{
    LaunchResult res{0, nullptr, 0};
    const StackArena stacks{(char*)stack_base, stack_count, (size_t)stack_stride};
    run_blocks(body, args, grid, block, poison, shmem, seed, order, first, stride, stacks, ranges, names, nranges,
               err, errlen, &res);
    *fault_addr = res.fault_addr;
    *fault_sig = res.fault_sig;
    return res.status;
}
#endif  // EMU_RT_DEFINE

// Counter mode: runs blocks ids[0..n_ids) (linear block numbers) of a launch on the
// calling OS thread and adds its counts to `out` (CNT_TOTALS values, then
// CNT_PER_RANGE per range). Results of the blocks not run are not written.
EMU_RT int launch_counted(void (*body)(void**), void** args, const unsigned* grid,
                  const unsigned* block, void (*poison)(unsigned), unsigned shmem, unsigned long long seed,
                  int order, const unsigned long long* ids, unsigned long long n_ids, void* stack_base,
                  int stack_count, unsigned long long stack_stride, const unsigned long long* ranges,
                  const char* const* names, int nranges, char* err, int errlen, void** fault_addr,
                  int* fault_sig, unsigned long long* out, unsigned long long* sites_out, int max_sites)
#if !EMU_RT_DEFINE
    ;
#else
{
    LaunchResult res{0, nullptr, 0};
    const StackArena stacks{(char*)stack_base, stack_count, (size_t)stack_stride};
    Count cnt;
    cnt_init(&cnt, out, nranges);
    __atomic_fetch_add(&g_counting, 1, __ATOMIC_RELAXED);
    run_blocks(body, args, grid, block, poison, shmem, seed, order, 0, 1, stacks, ranges, names, nranges,
               err, errlen, &res, ids, n_ids, &cnt);
    __atomic_fetch_sub(&g_counting, 1, __ATOMIC_RELAXED);
    if (res.status == 0) {
        cnt_finish(&cnt, sites_out, max_sites);
        pdl_export(&cnt);
    }
    tl_pdl_out = nullptr;
    cnt_free(&cnt);
    *fault_addr = res.fault_addr;
    *fault_sig = res.fault_sig;
    return res.status;
}
#endif  // EMU_RT_DEFINE

}  // namespace emu
// Counter mode: the next counted launch on this OS thread writes its sector table to `out`
// (cap entries at most; out[0] = the entries it has, which may exceed cap).
#if EMU_RT_DEFINE
extern "C" __attribute__((visibility("default"))) EMU_INTERNAL void emu_pdl_export(unsigned long long* out,
                                                                                   unsigned long long cap) {
    emu::tl_pdl_out = out;
    emu::tl_pdl_cap = cap;
}
#endif  // EMU_RT_DEFINE
namespace emu {
template <typename EmuT> static inline unsigned long long to_bits(EmuT v) {
    static_assert(sizeof(EmuT) <= 8, "warp collectives move at most 8 bytes");
    unsigned long long u = 0;
    std::memcpy(&u, &v, sizeof(EmuT));
    return u;
}
template <typename EmuT> static inline EmuT from_bits(unsigned long long u) {
    EmuT v;
    std::memcpy(&v, &u, sizeof(EmuT));
    return v;
}
}  // namespace emu
