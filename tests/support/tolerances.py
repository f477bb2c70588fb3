"""The tolerance table lives in the library (``dflash_cupy.tolerances``), so the
demo checks steps with the same numbers the tests use."""
from dflash_cupy.tolerances import TOL, assert_close, within  # noqa: F401
