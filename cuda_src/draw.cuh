// draw.cuh — the seeded draw shared by the token sampler (sample.cu) and the DFlash 2
// selector's walk (selector.cu): Philox4x32-10 bits per (seed, counter base, row) and
// integer probability masses, so both kernels draw the same way and ops/sample.py's
// NumPy reference (philox4x32_10, row_uniform64) reproduces every draw.
//
//   rng u64 [2] = (seed, counter base);
//   row_bits64(row, rng) = c1 << 32 | c0 of Philox4x32-10(counter = (row, base lo, base hi, 0),
//                                                          key = (seed lo, seed hi));
//   draw_mass(z, m) = trunc(w * 2^40), w = 1 if z == m else expf(z - m); NaN z: 0.
//     (m = the row's largest z: integer masses make every sum exact and order-free.)
//   draw_target(bits, total) = floor(bits * total / 2^64): the drawn item is the first whose
//     running mass exceeds it (the inverse CDF at u = bits / 2^64).
#pragma once

__device__ __forceinline__ unsigned long long mulhi64(unsigned long long a, unsigned long long b)
{
    const unsigned long long al = a & 0xffffffffull, ah = a >> 32, bl = b & 0xffffffffull, bh = b >> 32;
    const unsigned long long p0 = al * bl, p1 = al * bh, p2 = ah * bl, p3 = ah * bh;
    const unsigned long long mid = (p0 >> 32) + (p1 & 0xffffffffull) + (p2 & 0xffffffffull);
    return p3 + (p1 >> 32) + (p2 >> 32) + (mid >> 32);
}

__device__ __forceinline__ void philox4x32_10(unsigned int c[4], unsigned int k0, unsigned int k1)
{
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
        const unsigned int hi0 = __umulhi(0xD2511F53u, c[0]), lo0 = 0xD2511F53u * c[0];
        const unsigned int hi1 = __umulhi(0xCD9E8D57u, c[2]), lo1 = 0xCD9E8D57u * c[2];
        const unsigned int n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
        c[0] = n0; c[1] = lo1; c[2] = n2; c[3] = lo0;
    }
}

__device__ __forceinline__ unsigned long long row_bits64(unsigned int row, const unsigned long long* rng)
{
    unsigned int c[4] = {row, (unsigned int)(rng[1] & 0xffffffffull), (unsigned int)(rng[1] >> 32), 0u};
    philox4x32_10(c, (unsigned int)(rng[0] & 0xffffffffull), (unsigned int)(rng[0] >> 32));
    return ((unsigned long long)c[1] << 32) | c[0];
}

__device__ __forceinline__ unsigned long long draw_mass(float z, float m)
{
    if (z != z) return 0ull;
    const float w = (z == m) ? 1.0f : expf(z - m);
    return (unsigned long long)(w * 1099511627776.0f);  // 2^40
}

__device__ __forceinline__ unsigned long long draw_target(unsigned long long bits, unsigned long long total)
{
    return mulhi64(bits, total);
}
