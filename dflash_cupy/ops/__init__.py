"""Kernel families: each module holds the launcher of a cuda_src file and its NumPy reference."""
