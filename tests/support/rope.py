"""RoPE helpers shared by the rope and qkv-epilogue tests."""
import numpy as np


def plain_table(d, theta=1e6):
    return theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
