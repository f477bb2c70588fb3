"""Helpers shared by the test modules (no tests here): tolerances, the fixed
drafters and their drivers, GEMM set-ups, NVRTC checks, recorded launches for
the cost-model tests, and the ``--differential`` pytest hooks. Test modules
import from here, never from each other."""
