// emu_builtins.h — part of cuda_emu.h (included by it only, after the parts before it).
// Built-ins kernels call: threadIdx/blockIdx/..., __syncthreads, warp
// shuffles, votes and syncs, mma.sync and ldmatrix, the PDL calls.
#pragma once

// ---------------------------------------------------------------- built-ins
#define threadIdx (::emu::tl_fiber->tidx)
#define blockIdx (::emu::tl_block->bidx)
#define blockDim (::emu::tl_block->bdim)
#define gridDim (::emu::tl_block->gdim)

static inline void __syncthreads() {
    emu::Block* b = emu::tl_block;
    emu::Fiber* f = emu::tl_fiber;
    f->state = emu::AT_BARRIER;
    if (++b->bar_arrived == b->live) emu::release_barrier(b);
    emu::switch_to_scheduler();
}
static inline int emu_sync_count(int pred) {
    emu::Block* b = emu::tl_block;
    emu::Fiber* f = emu::tl_fiber;
    f->state = emu::AT_BARRIER;
    b->bar_count += pred != 0;
    if (++b->bar_arrived == b->live) emu::release_barrier(b);
    emu::switch_to_scheduler();
    return f->bar_result;
}
static inline int __syncthreads_count(int pred) { return emu_sync_count(pred); }
static inline int __syncthreads_or(int pred) { return emu_sync_count(pred) != 0; }
static inline int __syncthreads_and(int pred) {
    const int live = emu::tl_block->live;
    return emu_sync_count(pred) == live;
}
static inline void __syncwarp(unsigned int mask = 0xffffffffu) {
    emu::warp_collective(emu::OP_SYNCWARP, 0, 0, 32, mask);
}
template <typename EmuT> static inline EmuT __shfl_sync(unsigned int mask, EmuT v, int src, int width = 32) {
    return emu::from_bits<EmuT>(emu::warp_collective(emu::OP_SHFL_IDX, emu::to_bits(v), src, width, mask));
}
template <typename EmuT> static inline EmuT __shfl_up_sync(unsigned int mask, EmuT v, unsigned int d, int width = 32) {
    return emu::from_bits<EmuT>(emu::warp_collective(emu::OP_SHFL_UP, emu::to_bits(v), (int)d, width, mask));
}
template <typename EmuT> static inline EmuT __shfl_down_sync(unsigned int mask, EmuT v, unsigned int d, int width = 32) {
    return emu::from_bits<EmuT>(emu::warp_collective(emu::OP_SHFL_DOWN, emu::to_bits(v), (int)d, width, mask));
}
template <typename EmuT> static inline EmuT __shfl_xor_sync(unsigned int mask, EmuT v, int m, int width = 32) {
    return emu::from_bits<EmuT>(emu::warp_collective(emu::OP_SHFL_XOR, emu::to_bits(v), m, width, mask));
}
static inline unsigned int __ballot_sync(unsigned int mask, int pred) {
    return (unsigned int)emu::warp_collective(emu::OP_BALLOT, pred != 0, 0, 32, mask);
}
static inline int __any_sync(unsigned int mask, int pred) {
    return (int)emu::warp_collective(emu::OP_ANY, pred != 0, 0, 32, mask);
}
static inline int __all_sync(unsigned int mask, int pred) {
    return (int)emu::warp_collective(emu::OP_ALL, pred != 0, 0, 32, mask);
}
// Tensor-core MMA for the wrappers in cuda_src/mma.cuh (never called by kernels directly).
static inline void emu_mma_m16n8k16(int bf16, float* d, const unsigned int* a, const unsigned int* b,
                                    const float* c) {
    emu::MmaLane lane{d, a, b, c};
    emu::warp_collective(bf16 ? emu::OP_MMA_BF16 : emu::OP_MMA_F16, (unsigned long long)&lane, 0, 32, 0xffffffffu);
}
// ldmatrix's emulation (cuda_src/ldmatrix.cuh) brackets its gathers with these:
// counter mode counts the instruction's rows, not the gathers. Each lane's row address must
// be 16-byte aligned and its 16 bytes in this block's shared memory (PTX ISA ldmatrix: ".shared"
// state space, rows of 16 bytes "aligned to 16 bytes"); the GPU faults or reads garbage otherwise.
static inline void emu_ldmatrix_begin(const void* row) {
    emu::check_ldmatrix_row(row);
    if (EMU_COUNTERS && emu::g_counting && emu::tl_cnt) emu::count_ldmatrix(row);
}
static inline void emu_ldmatrix_end() {
    if (EMU_COUNTERS && emu::g_counting && emu::tl_cnt) emu::tl_fiber->cnt_mute = 0;
}
// wgmma's emulation (cuda_src/wgmma.cuh; emu_tensor_core.h).
EMU_INTERNAL static inline void emu_wgmma_rs(int bf16, int n, float* d, const unsigned int* a, unsigned long long desc,
                                int scale_d) {
    emu::WgLaneArgs lane{d, a, desc, n, bf16, scale_d};
    emu::warp_collective(emu::OP_WGMMA, (unsigned long long)&lane, 0, 32, 0xffffffffu);
}
EMU_INTERNAL static inline void emu_wgmma_fence() {
    emu::wg_state(emu::tl_block->nthreads)->th[emu::tl_fiber->tid].fenced = 1;
}
EMU_INTERNAL static inline void emu_wgmma_commit() {
    emu::wg_state(emu::tl_block->nthreads)->th[emu::tl_fiber->tid].cur++;
}
EMU_INTERNAL static inline void emu_wgmma_wait(int n) {
    emu::WgState* s = emu::wg_state(emu::tl_block->nthreads);
    const unsigned cur = s->th[emu::tl_fiber->tid].cur;
    emu::wg_retire(s, emu::tl_fiber->tid, cur >= (unsigned)n ? cur - (unsigned)n : 0u);
}
EMU_INTERNAL static inline void emu_fence_proxy_async() {}
EMU_INTERNAL static inline unsigned long long emu_wgmma_desc(const void* smem, unsigned int lbo, unsigned int sbo) {
    return emu::wg_make_desc(smem, lbo, sbo);
}
// Programmatic dependent launch (cuda_src/pdl.cuh). Launches run one after another
// here, so the ordering they ask for always holds; the counter build records what
// each thread touches before its wait for the ordering check (pdl_order.py).
EMU_INTERNAL static inline void emu_pdl_wait() {
    emu::Fiber* f = emu::tl_fiber;
    f->pdl_waited = 1;
    emu::tl_block->pdl_waited = true;
    if (EMU_COUNTERS && emu::g_counting && emu::tl_cnt) ((emu::Count*)emu::tl_cnt)->out[emu::CNT_PDL_WAITS]++;
}
EMU_INTERNAL static inline void emu_pdl_launch_dependents() {
    if (EMU_COUNTERS && emu::g_counting && emu::tl_cnt && !emu::tl_fiber->pdl_waited)
        ((emu::Count*)emu::tl_cnt)->out[emu::CNT_PDL_EARLY_TRIGGERS]++;
}
// A prefetch must point into an array (checked as a one-byte load); counted only as a
// pre-wait touch of its byte, never as a load.
EMU_INTERNAL static inline void emu_prefetch_l2(const void* p) {
    const unsigned long long a = (unsigned long long)p;
    emu::check_access(a, 1, false);
    emu::MemTable* t = emu::tl_mem;
    emu::Fiber* f = emu::tl_fiber;
    emu::Count* c = (emu::Count*)emu::tl_cnt;
    if (!EMU_COUNTERS || !emu::g_counting || !c || !t || !t->count || !f || f->pdl_waited) return;
    int range = -1;
    if (emu::cnt_space(t, f, a, &range) == 0 && range < c->nranges) emu::cnt_bytes(c, range, a, 1, 2, true);
}
static inline unsigned int __activemask() { return 0xffffffffu; }
static inline unsigned int __lanemask_lt() { return (1u << (emu::tl_fiber->tid & 31)) - 1u; }
