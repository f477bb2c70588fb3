// Emulation shim: under g++ the CUDA headers are the emulation header.
#include "../cuda_emu.h"
