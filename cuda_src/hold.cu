// hold.cu — keeps a stream busy for a while: profiling only (profiling/kernel_times.py).
//
//   hold_stream(cycles): one thread spins until clock64() has advanced by `cycles`.
//
// Launch: grid 1, block 1, no shared memory, no arrays. Work queued behind it on the stream
// waits, so the host can enqueue a whole eager step (tens of launches from Python, each far
// slower than a small kernel) before the device runs its first kernel. The device then runs
// the step's kernels back to back, and an event after each one measures that kernel alone
// rather than the host's launch rate.
// clock64 counts SM clocks on a GPU; the emulator (cuda_emu.h) counts nanoseconds.

#include "pdl.cuh"

extern "C" __global__ void __launch_bounds__(1) hold_stream(long long cycles) {
    pdl_wait();   // like every kernel here (pdl.cuh); never launched with PDL, so it returns at once
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
}
