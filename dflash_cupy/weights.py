"""The drafter's weights as NumPy arrays keyed by their Hugging Face names (SPEC §5).

Tensor names and shapes (``[out, in]`` for matrices, as stored by HF):

=============================================  ==================================
name                                           shape
=============================================  ==================================
``fc.weight``                                  [H, fc_in]
``hidden_norm.weight``                         [H]
``norm.weight``                                [H]
``layers.{i}.input_layernorm.weight``          [H]
``layers.{i}.post_attention_layernorm.weight`` [H]
``layers.{i}.self_attn.q_proj.weight``         [nh*d, H]
``layers.{i}.self_attn.k_proj.weight``         [nkv*d, H]
``layers.{i}.self_attn.v_proj.weight``         [nkv*d, H]
``layers.{i}.self_attn.o_proj.weight``         [H, nh*d]
``layers.{i}.self_attn.q_norm.weight``         [d]
``layers.{i}.self_attn.k_norm.weight``         [d]
``layers.{i}.mlp.gate_proj.weight``            [I, H]
``layers.{i}.mlp.up_proj.weight``              [I, H]
``layers.{i}.mlp.down_proj.weight``            [H, I]
=============================================  ==================================

Optional variants (present iff the config enables them):

* ``aux_hidden_norms.{j}.weight`` [H], j < n_captured (``config.aux_hidden_norms``);
* ``layers.{i}.self_attn.gate_proj.weight`` [nh, H] (``attn_gate="head"``) or
  [nh*d, H] (``attn_gate="element"``); gate element ``h*d + e`` scales
  head ``h``, dim ``e``.

DFlash 2 drafters (``config.dflash2``; SPEC §6, z-lab's published layout), with
``taps = conv_kernel_size``, ``G = H / conv_group_size``, ``R = selector_rank``,
``V = vocab_size``:

* ``layers.{i}.attention_conv.base_kernel`` and ``layers.{i}.mlp_conv.base_kernel``
  [2, taps, H]: ``[0]`` the kernel before the sublayer, ``[1]`` after it;
* ``layers.{i}.attention_conv.kernel_projection.weight`` and
  ``layers.{i}.mlp_conv.kernel_projection.weight`` [2*taps*G, H]: output row
  ``(half*taps + tap)*G + group`` (the (half, tap, group) order of z-lab's
  ``.view(..., 2, taps, G)`` and vLLM's ``.reshape(n, 2, taps, G)``);
* ``candidate_selector.hidden_projection.weight`` [R, H];
* ``candidate_selector.predecessor_codebook`` and
  ``candidate_selector.successor_codebook`` [V, R] (stored without ``.weight``).

bf16 tensors are ``ml_dtypes.bfloat16`` arrays on the NumPy side.
"""
from __future__ import annotations

import json
import os
import types
import warnings

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from . import backends, dtypes
from .config import DraftConfig
from .device_weights import DeviceWeights

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_FROM_SAFETENSORS = {v: k for k, v in dtypes.SAFETENSORS.items()}


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read as the drafter's weights: the
    message names the file and what is wrong with it."""


def resolve_dtype(dtype) -> np.dtype:
    """np.float32 / np.float16 / ml_dtypes.bfloat16, or a name ("f32", "bf16",
    "float16", ...) -> the host np.dtype; TypeError otherwise."""
    return dtypes.host_dtype(dtype, "dtype")


def dtype_name(dt) -> str:
    try:
        return dtypes.kind_of(dt, "dtype", bits=False)
    except TypeError:
        return str(np.dtype(dt))


def expected_shapes(config: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the drafter needs for ``config``, name -> shape (module docstring)."""
    H, d, nh, nkv, inter = (config.hidden_size, config.head_dim, config.n_head,
                            config.n_head_kv, config.intermediate_size)
    s = {
        "fc.weight": (H, config.fc_in),
        "hidden_norm.weight": (H,),
        "norm.weight": (H,),
    }
    if config.aux_hidden_norms:
        for j in range(config.n_captured):
            s[f"aux_hidden_norms.{j}.weight"] = (H,)
    for i in range(config.n_layer):
        p = f"layers.{i}."
        s[p + "input_layernorm.weight"] = (H,)
        s[p + "post_attention_layernorm.weight"] = (H,)
        s[p + "self_attn.q_proj.weight"] = (nh * d, H)
        s[p + "self_attn.k_proj.weight"] = (nkv * d, H)
        s[p + "self_attn.v_proj.weight"] = (nkv * d, H)
        s[p + "self_attn.o_proj.weight"] = (H, nh * d)
        s[p + "self_attn.q_norm.weight"] = (d,)
        s[p + "self_attn.k_norm.weight"] = (d,)
        if config.attn_gate == "head":
            s[p + "self_attn.gate_proj.weight"] = (nh, H)
        elif config.attn_gate == "element":
            s[p + "self_attn.gate_proj.weight"] = (nh * d, H)
        s[p + "mlp.gate_proj.weight"] = (inter, H)
        s[p + "mlp.up_proj.weight"] = (inter, H)
        s[p + "mlp.down_proj.weight"] = (H, inter)
        d2 = config.dflash2
        if d2 is not None:
            for conv in ("attention_conv", "mlp_conv"):
                s[p + conv + ".base_kernel"] = (2, d2.conv_kernel_size, H)
                s[p + conv + ".kernel_projection.weight"] = (d2.projection_rows(H), H)
    d2 = config.dflash2
    if d2 is not None:
        s["candidate_selector.hidden_projection.weight"] = (d2.selector_rank, H)
        s["candidate_selector.predecessor_codebook"] = (d2.vocab_size, d2.selector_rank)
        s["candidate_selector.successor_codebook"] = (d2.vocab_size, d2.selector_rank)
    return s


def is_norm_weight(name: str) -> bool:
    """True for the 1-D norm scales (``*norm*.weight``)."""
    return "norm" in name


class DraftWeights:
    """The drafter's tensors (NumPy, host memory) plus their ``config``.

    ``tensors`` maps HF names to arrays of dtype float32, float16 or
    ml_dtypes.bfloat16; the constructor checks them against
    ``expected_shapes(config)``.

    The weights are immutable once built: ``tensors`` is a read-only mapping
    of read-only array views, so an edit raises instead of being silently
    missed by a copy already placed on a device (``device()`` places them once
    per backend and caches the result). To change a weight, build a new
    ``DraftWeights`` from ``dict(w.tensors)`` with the new array.

    ``placed`` (backend name -> device weights) builds weights that exist only
    on a device (benchmarks draw random weights there); their ``tensors`` is
    empty and ``device()`` on another backend raises.
    """

    def __init__(self, config: DraftConfig, tensors: dict, *, strict: bool = True,
                 placed: dict | None = None):
        if not isinstance(config, DraftConfig):
            raise TypeError(f"config must be a DraftConfig, got {type(config).__name__}")
        self.config = config
        if placed:
            if tensors:
                raise ValueError("placed weights take no host tensors")
            checked = {}
        else:
            checked = _check_tensors(config, dict(tensors), strict=strict, source="tensors")
        self._tensors = types.MappingProxyType({k: _read_only(a) for k, a in checked.items()})
        self._placed = dict(placed or {})
        self._host = not placed

    @property
    def tensors(self) -> types.MappingProxyType:
        """Name -> read-only array (see the class docstring)."""
        return self._tensors

    # ------------------------------------------------------------- access
    def __getitem__(self, name: str) -> np.ndarray:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"DraftWeights has no tensor {name!r}") from None

    def __contains__(self, name) -> bool:
        return name in self._tensors

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def keys(self):
        return self._tensors.keys()

    def items(self):
        return self._tensors.items()

    def layer(self, i: int, name: str) -> np.ndarray:
        """``layer(i, "self_attn.q_proj")`` -> ``tensors["layers.{i}.self_attn.q_proj.weight"]``."""
        return self[f"layers.{i}.{name}.weight"]

    @property
    def dtype(self):
        """The common dtype of all tensors, or None when they are mixed
        (``dtype_summary()`` then says which)."""
        dts = {a.dtype for a in self._tensors.values()}
        return dts.pop() if len(dts) == 1 else None

    def dtype_summary(self) -> str:
        """e.g. ``"bf16 x 58"`` or ``"bf16 x 56, f32 x 2"``."""
        counts: dict[str, int] = {}
        for a in self._tensors.values():
            k = dtype_name(a.dtype)
            counts[k] = counts.get(k, 0) + 1
        return ", ".join(f"{k} x {n}" for k, n in sorted(counts.items()))

    @property
    def nbytes(self) -> int:
        if not self._host:
            return sum(int(d.nbytes) for d in self._placed.values())
        return sum(a.nbytes for a in self._tensors.values())

    def astype(self, dtype) -> "DraftWeights":
        """A copy with every tensor converted (round to nearest even) to ``dtype``."""
        dt = resolve_dtype(dtype)
        return DraftWeights(self.config, {k: _convert(v, dt) for k, v in self._tensors.items()})

    def __repr__(self) -> str:
        c = self.config
        where = self.dtype_summary() if self._host else "on " + ", ".join(self._placed)
        return (f"{type(self).__name__}(n_layer={c.n_layer}, hidden={c.hidden_size}, "
                f"fc_in={c.fc_in}, {len(self._tensors)} tensors, {where}, "
                f"{self.nbytes / 2**20:.1f} MiB)")

    # ------------------------------------------------------------ creation
    @classmethod
    def random(cls, config: DraftConfig, seed: int = 0, dtype=np.float32) -> "DraftWeights":
        """Seeded random weights that keep activations O(1).

        Norm scales are uniform in [0.8, 1.2] (not all ones, so a skipped or
        misapplied norm changes the output); matrices are N(0, 1) / sqrt(in),
        so each projection of an O(1) row stays O(1). DFlash 2 tensors: each
        ``base_kernel`` is tap 0 uniform in [0.8, 1.2], later taps N(0, 0.3^2)
        (near the identity, but every tap matters); ``kernel_projection`` is
        0.3 N(0, 1) / sqrt(H), so the dynamic part is a visible correction; the
        codebooks are N(0, 1) / rank^(1/4), so the edge term is O(1) next to the
        unary values and moves the walk.
        """
        dt = resolve_dtype(dtype)
        rng = np.random.default_rng(seed)
        return cls(config, {name: _convert(_random_tensor(rng, name, shape), dt)
                            for name, shape in expected_shapes(config).items()})

    @classmethod
    def from_pretrained(cls, path, dtype=None, strict: bool = True, backend=None) -> "DraftWeights":
        """Load a checkpoint directory: ``config.json`` plus ``model.safetensors``
        or a sharded ``model.safetensors.index.json``.

        ``dtype=None`` keeps each tensor bit-exactly as stored (F32, F16, BF16);
        a dtype converts every tensor. A malformed file (empty, truncated,
        header not JSON or of absurd length, offsets past the end or
        overlapping, an unsupported dtype, a missing shard, a tensor missing,
        misshapen or in another shard than the index says) raises
        ``CheckpointError`` naming the file; unexpected tensors raise too
        unless ``strict=False``, which warns and drops them.
        ``backend`` (a name or a Backend): also place the weights on that
        backend now (``device(backend)``), so the first step pays nothing.
        """
        dt = None if dtype is None else resolve_dtype(dtype)
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"from_pretrained: {path!r} is not a checkpoint directory")
        config = DraftConfig.from_hf(path)
        tensors, where = {}, {}
        for f, names in _safetensors_files(path).items():
            for name, arr in _read_safetensors(f).items():
                if name in tensors:
                    raise CheckpointError(f"{f}: tensor {name!r} is also in {where[name]}")
                if names is not None and name not in names:
                    raise CheckpointError(f"{f}: holds tensor {name!r}, which the index "
                                          f"{INDEX_FILE} does not place in this shard")
                tensors[name] = arr if dt is None else _convert(arr, dt)
                where[name] = f
        checked = _check_tensors(config, tensors, strict=strict, source=path, where=where)
        weights = cls(config, checked)
        if backend is not None:
            weights.device(backend)
        return weights

    def device(self, backend=None) -> DeviceWeights:
        """The weights on ``backend`` (``DeviceWeights``: fused, device-resident),
        built once per backend and cached on this object."""
        be = backends.get(backend)
        placed = self._placed.get(be.name)
        if placed is None:
            if not self._host:
                raise ValueError(f"these weights live only on {', '.join(map(repr, self._placed))}, "
                                 f"not {be.name!r}")
            placed = self._placed[be.name] = DeviceWeights(self, be)
        return placed

    def save_pretrained(self, path) -> None:
        """Write ``config.json`` and ``model.safetensors`` (HF layout) into directory ``path``."""
        if not self._host:
            raise ValueError("weights that live only on a device cannot be saved")
        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        self.config.save(os.path.join(path, "config.json"))
        save_file({k: np.ascontiguousarray(v) for k, v in self._tensors.items()},
                  os.path.join(path, SINGLE_FILE), metadata={"format": "pt"})


# ---------------------------------------------------------------- helpers
def _random_tensor(rng, name: str, shape: tuple) -> np.ndarray:
    """One tensor of ``DraftWeights.random`` (its docstring gives the scales)."""
    if is_norm_weight(name):
        return rng.uniform(0.8, 1.2, size=shape)
    if name.endswith(".base_kernel"):
        a = 0.3 * rng.standard_normal(size=shape)
        a[:, 0, :] = rng.uniform(0.8, 1.2, size=(shape[0], shape[2]))
        return a
    if name.endswith("_codebook"):
        return rng.standard_normal(size=shape) / shape[1] ** 0.25
    a = rng.standard_normal(size=shape) / np.sqrt(shape[1])
    return 0.3 * a if name.endswith(".kernel_projection.weight") else a


def _read_only(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v


def _convert(a, dt: np.dtype) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype == dt:
        return np.ascontiguousarray(a)
    # round to nearest even; sources that load can hold (f32, f16) convert with a single
    # rounding, since f16 -> f32 is exact and ml_dtypes casts to bf16 from f32
    return np.ascontiguousarray(a.astype(dt))


def _check_tensors(config, tensors: dict, *, strict: bool, source: str, where=None) -> dict:
    """The tensors ``config`` needs, checked. ``where`` (name -> file) marks a
    checkpoint: its problems raise ``CheckpointError`` naming the file."""
    err = ValueError if where is None else CheckpointError

    def origin(n):
        return source if where is None else where[n]

    shapes = expected_shapes(config)
    missing = [n for n in shapes if n not in tensors]
    if missing:
        more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
        raise err(f"{source}: missing tensor(s) "
                  + ", ".join(f"{n} {list(shapes[n])}" for n in missing[:8]) + more)
    out = {}
    for n, shape in shapes.items():
        a = tensors[n]
        if not isinstance(a, np.ndarray):
            raise TypeError(f"{source}: tensor {n!r} is a {type(a).__name__}, not a NumPy array")
        try:
            dtypes.kind_of(a.dtype, n, bits=False)
        except TypeError:
            raise err(f"{origin(n)}: tensor {n!r} has dtype {a.dtype}; expected float32, "
                      "float16 or bfloat16") from None
        if tuple(a.shape) != shape:
            raise err(f"{origin(n)}: tensor {n!r} has shape {list(a.shape)}, expected "
                      f"{list(shape)}")
        out[n] = a
    unexpected = sorted(n for n in tensors if n not in shapes)
    if unexpected:
        msg = (f"{source}: unexpected tensor(s) not used by this config: "
               + ", ".join(unexpected))
        if strict:
            raise err(msg + " (pass strict=False to ignore them)")
        warnings.warn(msg + " (ignored)", stacklevel=3)
    return out


def _safetensors_files(path: str) -> dict:
    """Shard path -> the tensor names the index places in it (None: no index)."""
    index = os.path.join(path, INDEX_FILE)
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                wm = json.load(f).get("weight_map")
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a JSON index object ({e})") from None
        if not isinstance(wm, dict) or not wm or not all(isinstance(v, str) for v in wm.values()):
            raise CheckpointError(f"{index}: no 'weight_map' of tensor name -> shard file")
        files: dict[str, set] = {}
        for name, shard in wm.items():
            p = os.path.join(path, shard)
            if not os.path.isfile(p):
                raise CheckpointError(f"{index}: shard {shard!r} (holding {name!r}) is missing")
            files.setdefault(p, set()).add(name)
        return files
    if os.path.isfile(single):
        return {single: None}
    raise FileNotFoundError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of one file, bit-exact (the safetensors package checks the
    header, offsets and sizes); any fault raises ``CheckpointError`` naming it."""
    out = {}
    try:
        with safe_open(path, framework="numpy") as f:
            for name in f.keys():
                st = f.get_slice(name).get_dtype()
                if st not in _FROM_SAFETENSORS:
                    raise CheckpointError(f"{path}: tensor {name!r} has dtype {st}; supported: "
                                          f"{', '.join(_FROM_SAFETENSORS)}")
                out[name] = np.ascontiguousarray(f.get_tensor(name))
    except (SafetensorError, OSError, MemoryError, OverflowError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file: "
                              f"{type(e).__name__}: {e}") from None
    return out
