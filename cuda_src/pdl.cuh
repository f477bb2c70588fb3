// pdl.cuh — programmatic dependent launch (PDL, sm_90+): the device half.
//
// A kernel B launched with the programmatic-stream-serialization attribute right
// after kernel A on a stream (a graph node captured that way) may start once
// every block of A has executed pdl_launch_dependents() or exited. B's
// pdl_wait() returns only once A has completed and its memory is visible
// (PTX griddepcontrol: "all prerequisite grids in flight have completed").
// So what B does before its wait must neither read what A writes nor write
// what A reads or writes: only immutable data (the weights) may be touched,
// e.g. prefetch_l2() of the first weights a GEMM streams.
//
// The rules every step kernel follows (checked on the CPU by the emulator's
// PDL mode, dflash_cupy/emu/pdl_order.py):
//   - pdl_wait() before any access to data another kernel of the step writes
//     or reads (in practice: before everything except weight prefetches), and
//     before any early return, so every block waits;
//   - pdl_launch_dependents() only after this thread's pdl_wait(): a trigger
//     before the wait would let the next kernel start before the one before
//     this kernel finished, which its own pre-wait part does not allow for.
// Without the attribute (eager launches, bulk appends, older GPUs) both are
// no-ops, so kernels always contain them. Before sm_90 they compile to nothing.
// Under the emulator (cuda_emu.h) launches run one after another; its counter
// build records per thread whether the wait has run, for the ordering check.
// DFLASH_FAULT_PDL_NOWAIT (defined only by tests/test_selfcheck_faults.py for one kernel file,
// never by a launcher: dflash_cupy.kernels.compile_options refuses DFLASH_FAULT_* names) leaves
// the wait out, the fault the self-check (dflash_cupy/selfcheck.py) must catch.
#pragma once

__device__ __forceinline__ void pdl_wait() {
#ifndef DFLASH_FAULT_PDL_NOWAIT  // (test-only fault, tests/test_selfcheck_faults.py: the wait left out)
#ifdef __CUDA_ARCH__
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
#else
    emu_pdl_wait();
#endif
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#ifdef __CUDA_ARCH__
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
#else
    emu_pdl_launch_dependents();
#endif
}

// A hint that the 128-byte line holding p will be read soon: fetched into L2,
// no register written, nothing waited for. p must point into an array (the
// emulator checks it as a one-byte load).
__device__ __forceinline__ void prefetch_l2(const void* p) {
#ifdef __CUDA_ARCH__
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
#else
    emu_prefetch_l2(p);
#endif
}
