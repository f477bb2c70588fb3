"""dflash_cupy: the DFlash drafter's ring-cached context KV as CuPy raw kernels,
with a CPU emulation backend that runs the same CUDA C.

The main objects: ``DraftConfig`` / ``DraftWeights`` (a drafter checkpoint),
``FeatureRing`` (the target's captured hidden states), ``DraftKvCache`` (the
drafter step, replayed as one captured graph), ``DraftKvBatch`` (many requests'
steps in one graph); ``backends.get()`` picks CuPy
or the emulator; ``selfcheck()`` checks every kernel variant on this device
(caches obey its cached verdict)."""
__version__ = "0.1.0"

from .config import DraftConfig  # noqa: E402,F401
from .feature_ring import FeatureRing  # noqa: E402,F401
from .kv_cache import DraftKvCache  # noqa: E402,F401
from .kv_batch import DraftKvBatch  # noqa: E402,F401
from .ops.sample import SamplingParams  # noqa: E402,F401
from .weights import DraftWeights  # noqa: E402,F401
from . import selfcheck  # noqa: E402,F401  (callable: dflash_cupy.selfcheck(backend=None) -> Report)

__all__ = ["DraftConfig", "DraftWeights", "FeatureRing", "DraftKvCache", "DraftKvBatch", "SamplingParams",
           "selfcheck", "__version__"]
