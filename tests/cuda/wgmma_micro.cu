// nvrtc-arch: sm_90a
// nvrtc-check: -DWG_N=8
// nvrtc-check: -DWG_N=16
// nvrtc-check: -DWG_N=32
// nvrtc-check: -DWG_N=128
// nvrtc-check: -DWG_N=256
// wgmma_micro.cu — tests/test_wgmma.py's micro-kernel for cuda_src/wgmma.cuh: each warpgroup
// of the block computes D[64][WG_N] = (scale_d ? C : 0) + A[64][16 K] * B[WG_N][16 K]^T with
// one wgmma per k16 step, A's rows from registers, B staged in shared memory as the host laid
// it out (K-major core matrices, LBO/SBO apart, padding between them), one commit group per
// step. `mode` bends one rule at a time so the emulator's checks can be tested:
//   0 the rules; 1 d copied out before the wait; 2 B overwritten (with B2) before the wait;
//   3 no wait; 4 swizzle bits set; 5 a descriptor of global memory; 6 a misaligned start;
//   7 no wgmma_fence; 8 B read past the end of the shared buffer; 9 wait<1> inside the loop;
//   10 an accumulator written before the wait; 11 an A register changed before the wait.
#include "wgmma.cuh"
#ifndef WG_N
#define WG_N 64
#endif
#ifndef WG_KSTEPS
#define WG_KSTEPS 2
#endif

// A: [rows][16 * WG_KSTEPS] 16-bit patterns, row-major (rows = 64 per warpgroup).
// b_image / b2_image: `b_words` 16-byte words copied verbatim into shared memory.
// C, D: [rows][WG_N] f32.
extern "C" __global__ void wgmma_tile(const unsigned short* A, const uint4* b_image, const uint4* b2_image,
                                      int b_words, int lbo, int sbo, int step_bytes, const float* C, float* D,
                                      int bf16, int scale_d, int mode) {
    extern __shared__ uint4 b_smem[];
    for (int i = threadIdx.x; i < b_words; i += blockDim.x) b_smem[i] = b_image[i];
    fence_proxy_async_shared();
    __syncthreads();

    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int row0 = 16 * (threadIdx.x >> 5) + g;  // warp w of warpgroup q owns rows 64 q + 16 w ..
    const int lda = 16 * WG_KSTEPS;
    float d[WG_N / 2];
    for (int j = 0; j < WG_N / 8; j++)
        for (int i = 0; i < 4; i++) d[4 * j + i] = C[(row0 + ((i & 2) ? 8 : 0)) * WG_N + 8 * j + 2 * t + (i & 1)];

    unsigned int a[WG_KSTEPS][4];
    for (int s = 0; s < WG_KSTEPS; s++)
        for (int r = 0; r < 4; r++) {
            const int row = row0 + ((r & 1) ? 8 : 0), col = 16 * s + 2 * t + ((r & 2) ? 8 : 0);
            a[s][r] = (unsigned int)A[row * lda + col] | ((unsigned int)A[row * lda + col + 1] << 16);
        }

    const unsigned char* base = reinterpret_cast<const unsigned char*>(b_smem);
    if (mode == 5) base = reinterpret_cast<const unsigned char*>(b_image);
    if (mode == 6) base += 8;
    if (mode != 7) wgmma_fence();
    for (int s = 0; s < WG_KSTEPS; s++) {
        unsigned long long desc = wgmma_desc_kmajor_noswizzle(base + s * step_bytes, lbo, sbo);
        if (mode == 4) desc |= 1ull << 62;
        if (mode == 8) desc += (unsigned long long)(b_words * 16 - 128) >> 4;  // the last core matrix
        if (bf16) wgmma_m64nNk16_rs_bf16<WG_N>(d, a[s], desc, s == 0 ? scale_d : 1);
        else wgmma_m64nNk16_rs_f16<WG_N>(d, a[s], desc, s == 0 ? scale_d : 1);
        wgmma_commit_group();
        if (mode == 9) wgmma_wait_group<1>();
    }
    if (mode == 1)
        for (int j = 0; j < WG_N / 8; j++)
            for (int i = 0; i < 4; i++)
                D[(row0 + ((i & 2) ? 8 : 0)) * WG_N + 8 * j + 2 * t + (i & 1)] = d[4 * j + i];
    if (mode == 2) {
        __syncthreads();
        for (int i = threadIdx.x; i < b_words; i += blockDim.x) b_smem[i] = b2_image[i];
        fence_proxy_async_shared();
        __syncthreads();
    }
    if (mode == 10) d[WG_N / 2 - 1] = 0.0f;
    if (mode == 11) a[0][3] ^= 1u;
    if (mode != 3) wgmma_wait_group<0>();
    wgmma_fence_operands<WG_N>(d);
    if (mode != 1)
        for (int j = 0; j < WG_N / 8; j++)
            for (int i = 0; i < 4; i++)
                D[(row0 + ((i & 2) ? 8 : 0)) * WG_N + 8 * j + 2 * t + (i & 1)] = d[4 * j + i];
}
