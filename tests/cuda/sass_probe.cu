// Known-answer kernels for the SASS reader (tests/test_sass.py): what each compiles to is
// easy to count by hand (loads in flight, round trips, trips), so the reader is checked on them.
extern "C" __global__ void probe_independent8(const float4* __restrict__ x, float4* __restrict__ y, int n) {
    // 8 independent 16-byte loads per iteration, summed (as compiled, the sum starts before the
    // last loads issue: 2 round trips)
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x * 8) {
        float4 a[8];
#pragma unroll
        for (int j = 0; j < 8; j++) a[j] = __ldcg(x + i + j * gridDim.x * blockDim.x);
        float4 s = a[0];
#pragma unroll
        for (int j = 1; j < 8; j++) { s.x += a[j].x; s.y += a[j].y; s.z += a[j].z; s.w += a[j].w; }
        y[i] = s;
    }
}

extern "C" __global__ void probe_chain8(const int* __restrict__ next, int* __restrict__ out) {
    // a pointer chase: each load's address is the previous load's value
    int p = threadIdx.x;
#pragma unroll
    for (int j = 0; j < 8; j++) p = __ldcg(next + p);
    out[threadIdx.x] = p;
}

extern "C" __global__ void probe_reduce_one_quad(const float4* __restrict__ ws, float4* __restrict__ y, int stride) {
    // a reduction whose loads land in one register quad, each added before the next issues
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 1
    for (int z = 0; z < 8; z++) {
        const float4 v = __ldcg(ws + z * stride + threadIdx.x);
        acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
    }
    y[threadIdx.x] = acc;
}

extern "C" __global__ void probe_reduce_separate(const float4* __restrict__ ws, float4* __restrict__ y, int stride) {
    // the same sum (same order) from 8 loads into separate registers, all in flight together
    float4 v[8];
#pragma unroll
    for (int z = 0; z < 8; z++) v[z] = __ldcg(ws + z * stride + threadIdx.x);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int z = 0; z < 8; z++) { acc.x += v[z].x; acc.y += v[z].y; acc.z += v[z].z; acc.w += v[z].w; }
    y[threadIdx.x] = acc;
}

extern "C" __global__ void probe_independent8_store(const float4* __restrict__ x, float4* __restrict__ y, int n) {
    const int s = gridDim.x * blockDim.x;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += s * 8) {
        float4 a[8];
#pragma unroll
        for (int j = 0; j < 8; j++) a[j] = __ldcg(x + i + j * s);
#pragma unroll
        for (int j = 0; j < 8; j++) y[i + j * s] = a[j];
    }
}
