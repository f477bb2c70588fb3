// arrive.cuh — the arrival ticket of a split launch: the blocks of one unit (the K slices
// of a GEMM tile, the key splits of an attention row group) each publish a partial and
// count themselves in; the block that draws the last ticket reads every partial.
//
// Memory order, the PTX memory model's release/acquire pattern (as CUTLASS's split-K
// semaphore and cooperative groups' grid sync): __syncthreads orders every thread's partial
// stores before thread 0's arrival; the arrival is one atom.add.acq_rel.gpu, a release
// (cumulative over what the barrier ordered before it) for the other blocks and an acquire
// of theirs for the last one; the second __syncthreads hands that acquire to the block's
// readers, which read the partials with __ldcg (L2: other SMs wrote them).
// Compiled (sm_90): MEMBAR.ALL.GPU + ATOMG + CCTL.IVALL in thread 0 (profiling/sass.py reads
// it; docs/decisions/kernels.md: why not __threadfence()).
// The emulator runs the same order with a C++ acq_rel read-modify-write.
#pragma once

__device__ __forceinline__ int atomic_add_acq_rel_gpu(int* p, int v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    int old;
    asm volatile("atom.add.acq_rel.gpu.global.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
#elif defined(__CUDA_ARCH__)
    __threadfence();
    const int old = atomicAdd(p, v);
    __threadfence();
    return old;
#else
    return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL);
#endif
}

// Called by every thread of the block after its partial stores: true (in every thread) in
// the block that arrived last of `n` on *counter. `ticket`: an int of the block's shared
// memory that no thread uses any more. The caller resets *counter once it has read.
__device__ __forceinline__ bool last_block_to_arrive(int* counter, int n, int* ticket) {
    __syncthreads();
    if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) *ticket = atomic_add_acq_rel_gpu(counter, 1);
    __syncthreads();
    return *ticket == n - 1;
}
