// cuda_emu.h — run CUDA C kernels on the CPU (g++), the one place where the
// CPU and the GPU differ. Kernel files in cuda_src/ include <cuda_fp16.h> /
// <cuda_bf16.h> / <math_constants.h>; under g++ those resolve to
// dflash_cupy/emu/cuda/include/*.h, which include this file.
//
// Model:
// - A launch runs the blocks of its grid one after another (or spread over a
//   few OS threads, each with its own blocks); the threads of a block are
//   user-space fibers on one OS thread. A fiber runs until it reaches a
//   barrier or a warp collective, then the scheduler picks the next runnable
//   fiber, in forward, reverse or seeded-shuffled order, so a missing
//   __syncthreads shows up as a wrong result rather than hiding behind a
//   friendly order.
// - `__shared__` is `thread_local`: one copy per OS thread, i.e. per block in
//   flight. `extern __shared__` buffers are defined once per name in a library
//   every module links (build.dynamic_shared) and poisoned with 0xFF (NaN for
//   f32/f16) before each block.
// - f32 arithmetic runs with FTZ/DAZ set in MXCSR, as CuPy compiles with
//   -ftz=true. Conversions to/from f16/bf16 are bit-exact round-to-nearest-even.
// - Deadlocks (a barrier or a collective not reached by every live thread)
//   and faults (guard pages around every emulated device array, integer
//   division by zero) end the launch with an error message, not a crash.
// - After this header, names that NVRTC lacks (std, <cstdint> types,
//   INFINITY, NAN) are poisoned so g++ rejects what NVRTC would reject.
#pragma once
#ifndef DFLASH_CUDA_EMU_H
#define DFLASH_CUDA_EMU_H

#include <algorithm>
#include <atomic>
#include <cmath>
#include <csetjmp>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <vector>
#include <sys/mman.h>
#include <unistd.h>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

// The runtime (block runner, scheduler, warp collectives, the memory checks' entry
// points) is compiled once per flag set into an object that every module links
// (build.py, runtime_object: EMU_RT_DEFINE=1); a kernel's translation unit sees
// only its declarations, so g++ does not generate it again for each kernel. The
// state both use is hidden (EMU_SHARED): still one copy per module.
#ifndef EMU_RT_DEFINE
#define EMU_RT_DEFINE 0
#endif
#if EMU_RT_DEFINE
#define EMU_SHARED __attribute__((visibility("hidden")))
#else
#define EMU_SHARED extern __attribute__((visibility("hidden")))
#endif
// Thread-locals: local-dynamic, as for a static one (the default for an extern one is the
// slower general-dynamic access on every read).
#define EMU_SHARED_TLS EMU_SHARED __attribute__((tls_model("local-dynamic"))) __thread
#define EMU_RT __attribute__((visibility("hidden"))) EMU_INTERNAL  // defined in the runtime object only

// The parts, in dependency order (each needs the ones above it):
#include "emu_language.h"
#include "emu_fibers.h"
#include "emu_memcheck.h"
#include "emu_counters.h"
#include "emu_tensor_core.h"
#include "emu_launch.h"
#include "emu_builtins.h"

// Names NVRTC does not know: using them in a kernel must fail here too.
#undef INFINITY
#undef NAN
#pragma GCC poison std uint8_t int8_t uint16_t int16_t uint32_t int32_t uint64_t int64_t INFINITY NAN

#endif  // DFLASH_CUDA_EMU_H
