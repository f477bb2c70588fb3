"""dflash_cupy: the DFlash drafter's ring-cached context KV as CuPy raw kernels,
with a CPU emulation backend that runs the same CUDA C."""
__version__ = "0.1.0"
