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

bf16 tensors are ``ml_dtypes.bfloat16`` arrays on the NumPy side.
"""
from __future__ import annotations

import json
import os
import struct
import warnings

import ml_dtypes
import numpy as np

from .config import DraftConfig

BF16 = np.dtype(ml_dtypes.bfloat16)
_ST_TO_NP = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": BF16}
_NP_TO_ST = {v: k for k, v in _ST_TO_NP.items()}
_DTYPE_ALIASES = {
    "f32": np.float32, "float32": np.float32, "fp32": np.float32,
    "f16": np.float16, "float16": np.float16, "fp16": np.float16, "half": np.float16,
    "bf16": BF16, "bfloat16": BF16,
}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def resolve_dtype(dtype) -> np.dtype:
    """np.float32 / np.float16 / ml_dtypes.bfloat16, or "f32" / "f16" / "bf16" -> np.dtype."""
    if isinstance(dtype, str):
        key = dtype.lower()
        if key not in _DTYPE_ALIASES:
            raise ValueError(f"dtype={dtype!r}: expected one of 'f32', 'f16', 'bf16'")
        return np.dtype(_DTYPE_ALIASES[key])
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype={dtype!r}: expected float32, float16 or bfloat16") from None
    if dt not in _NP_TO_ST:
        raise ValueError(f"dtype={dtype!r}: expected float32, float16 or bfloat16")
    return dt


def dtype_name(dt) -> str:
    return {"F32": "f32", "F16": "f16", "BF16": "bf16"}.get(_NP_TO_ST.get(np.dtype(dt)),
                                                            str(np.dtype(dt)))


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
    return s


def is_norm_weight(name: str) -> bool:
    """True for the 1-D norm scales (``*norm*.weight``)."""
    return "norm" in name


class DraftWeights:
    """The drafter's tensors (NumPy, host memory) plus their ``config``.

    ``tensors`` maps HF names to arrays of dtype float32, float16 or
    ml_dtypes.bfloat16; the constructor checks them against
    ``expected_shapes(config)``.
    """

    def __init__(self, config: DraftConfig, tensors: dict, *, strict: bool = True):
        if not isinstance(config, DraftConfig):
            raise TypeError(f"config must be a DraftConfig, got {type(config).__name__}")
        self.config = config
        self.tensors = _check_tensors(config, dict(tensors), strict=strict, source="tensors")

    # ------------------------------------------------------------- access
    def __getitem__(self, name: str) -> np.ndarray:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"DraftWeights has no tensor {name!r}") from None

    def __contains__(self, name) -> bool:
        return name in self.tensors

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def keys(self):
        return self.tensors.keys()

    def items(self):
        return self.tensors.items()

    def layer(self, i: int, name: str) -> np.ndarray:
        """``layer(i, "self_attn.q_proj")`` -> ``tensors["layers.{i}.self_attn.q_proj.weight"]``."""
        return self[f"layers.{i}.{name}.weight"]

    @property
    def dtype(self):
        """The common dtype of all tensors, or None when they are mixed
        (``dtype_summary()`` then says which)."""
        dts = {a.dtype for a in self.tensors.values()}
        return dts.pop() if len(dts) == 1 else None

    def dtype_summary(self) -> str:
        """e.g. ``"bf16 x 58"`` or ``"bf16 x 56, f32 x 2"``."""
        counts: dict[str, int] = {}
        for a in self.tensors.values():
            k = dtype_name(a.dtype)
            counts[k] = counts.get(k, 0) + 1
        return ", ".join(f"{k} x {n}" for k, n in sorted(counts.items()))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.tensors.values())

    def astype(self, dtype) -> "DraftWeights":
        """A copy with every tensor converted (round to nearest even) to ``dtype``."""
        dt = resolve_dtype(dtype)
        return DraftWeights(self.config, {k: _convert(v, dt) for k, v in self.tensors.items()})

    def __repr__(self) -> str:
        c = self.config
        return (f"DraftWeights(n_layer={c.n_layer}, hidden={c.hidden_size}, fc_in={c.fc_in}, "
                f"{len(self.tensors)} tensors, {self.dtype_summary()}, "
                f"{self.nbytes / 2**20:.1f} MiB)")

    # ------------------------------------------------------------ creation
    @classmethod
    def random(cls, config: DraftConfig, seed: int = 0, dtype=np.float32) -> "DraftWeights":
        """Seeded random weights that keep activations O(1).

        Norm scales are uniform in [0.8, 1.2] (not all ones, so a skipped or
        misapplied norm changes the output); matrices are N(0, 1) / sqrt(in),
        so each projection of an O(1) row stays O(1).
        """
        dt = resolve_dtype(dtype)
        rng = np.random.default_rng(seed)
        tensors = {}
        for name, shape in expected_shapes(config).items():
            if is_norm_weight(name):
                a = rng.uniform(0.8, 1.2, size=shape)
            else:
                a = rng.standard_normal(size=shape) / np.sqrt(shape[1])
            tensors[name] = _convert(a, dt)
        return cls(config, tensors)

    @classmethod
    def from_pretrained(cls, path, dtype=None, strict: bool = True, backend=None) -> "DraftWeights":
        """Load a checkpoint directory: ``config.json`` plus ``model.safetensors``
        or a sharded ``model.safetensors.index.json``.

        ``dtype=None`` keeps each tensor bit-exactly as stored (F32, F16, BF16);
        a dtype converts every tensor. Missing or misshapen tensors raise
        ValueError naming them; unexpected tensors raise too unless
        ``strict=False``, which warns and drops them.
        ``backend`` (a name or a Backend): also place the weights on that
        backend now (``device(backend)``), so the first step pays nothing.
        """
        dt = None if dtype is None else resolve_dtype(dtype)
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"from_pretrained: {path!r} is not a checkpoint directory")
        config = DraftConfig.from_hf(path)
        files = _safetensors_files(path)
        tensors = {}
        for f in files:
            for name, arr in _read_safetensors(f).items():
                if name in tensors:
                    raise ValueError(f"from_pretrained: tensor {name!r} appears in more than one "
                                     f"shard (again in {os.path.basename(f)})")
                tensors[name] = arr if dt is None else _convert(arr, dt)
        weights = cls(config, _check_tensors(config, tensors, strict=strict, source=path))
        if backend is not None:
            weights.device(backend)
        return weights

    def device(self, backend=None):
        """The weights on ``backend`` (``DeviceWeights``: fused, device-resident),
        built once per backend and cached on this object."""
        from . import backends
        from .device_weights import DeviceWeights
        be = backends.get(backend)
        cache = self.__dict__.setdefault("_device_cache", {})
        if be.name not in cache:
            cache[be.name] = DeviceWeights(self, be)
        return cache[be.name]

    def save_pretrained(self, path) -> None:
        """Write ``config.json`` and ``model.safetensors`` (HF layout) into directory ``path``."""
        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        self.config.save(os.path.join(path, "config.json"))
        _write_safetensors(os.path.join(path, SINGLE_FILE), self.tensors)


# ---------------------------------------------------------------- helpers
def _convert(a, dt: np.dtype) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype == dt:
        return np.ascontiguousarray(a)
    # round to nearest even; sources that load can hold (f32, f16) convert with a single
    # rounding, since f16 -> f32 is exact and ml_dtypes casts to bf16 from f32
    return np.ascontiguousarray(a.astype(dt))


def _check_tensors(config, tensors: dict, *, strict: bool, source: str) -> dict:
    shapes = expected_shapes(config)
    missing = [n for n in shapes if n not in tensors]
    if missing:
        more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
        raise ValueError(f"{source}: missing tensor(s) "
                         + ", ".join(f"{n} {list(shapes[n])}" for n in missing[:8]) + more)
    out = {}
    for n, shape in shapes.items():
        a = tensors[n]
        if not isinstance(a, np.ndarray):
            raise TypeError(f"{source}: tensor {n!r} is a {type(a).__name__}, not a NumPy array")
        if a.dtype not in _NP_TO_ST:
            raise ValueError(f"{source}: tensor {n!r} has dtype {a.dtype}; expected float32, "
                             "float16 or bfloat16")
        if tuple(a.shape) != shape:
            raise ValueError(f"{source}: tensor {n!r} has shape {list(a.shape)}, expected "
                             f"{list(shape)}")
        out[n] = a
    unexpected = sorted(n for n in tensors if n not in shapes)
    if unexpected:
        msg = (f"{source}: unexpected tensor(s) not used by this config: "
               + ", ".join(unexpected))
        if strict:
            raise ValueError(msg + " (pass strict=False to ignore them)")
        warnings.warn(msg + " (ignored)", stacklevel=3)
    return out


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, INDEX_FILE)
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            wm = json.load(f).get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise ValueError(f"{index}: no 'weight_map'")
        files = []
        for shard in dict.fromkeys(wm.values()):  # first-seen order, no repeats
            p = os.path.join(path, shard)
            if not os.path.isfile(p):
                raise FileNotFoundError(f"{index}: shard {shard!r} is missing")
            files.append(p)
        return files
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of one file, bit-exact. Uses the safetensors package; a
    tensor it cannot return as NumPy (older releases lack bf16) is read from
    the raw bytes instead."""
    from safetensors import safe_open

    header = _read_header(path)
    out = {}
    with safe_open(path, framework="numpy") as f:
        for name in f.keys():
            st_dtype = header[name]["dtype"]
            if st_dtype not in _ST_TO_NP:
                raise ValueError(f"{path}: tensor {name!r} has dtype {st_dtype}; supported: "
                                 f"{', '.join(_ST_TO_NP)}")
            try:
                a = f.get_tensor(name)
            except Exception:
                a = None
            want = _ST_TO_NP[st_dtype]
            if a is None or a.dtype != want:
                a = _read_raw_tensor(path, header, name)
            out[name] = np.ascontiguousarray(a)
    return out


def _read_header(path: str) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    header["__data_start__"] = 8 + n
    return header


def _read_raw_tensor(path: str, header: dict, name: str) -> np.ndarray:
    info = header[name]
    dt = _ST_TO_NP[info["dtype"]]
    b, e = info["data_offsets"]
    with open(path, "rb") as f:
        f.seek(header["__data_start__"] + b)
        raw = f.read(e - b)
    n = int(np.prod(info["shape"], dtype=np.int64))
    if len(raw) != n * dt.itemsize:
        raise ValueError(f"{path}: tensor {name!r} holds {len(raw)} bytes, expected "
                         f"{n * dt.itemsize}")
    # via uint16/uint32 bit patterns so no value conversion can happen
    bits = np.frombuffer(raw, dtype=np.dtype(f"<u{dt.itemsize}"))
    return bits.view(dt).reshape(info["shape"]).copy()


def _write_safetensors(path: str, tensors: dict) -> None:
    from safetensors.numpy import save_file

    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    try:
        save_file(arrays, path, metadata={"format": "pt"})
        return
    except Exception:
        pass  # e.g. a safetensors release without bf16 in its NumPy API
    _write_safetensors_raw(path, arrays)


def _write_safetensors_raw(path: str, arrays: dict) -> None:
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for k in sorted(arrays):
        a = arrays[k]
        raw = a.view(np.dtype(f"<u{a.dtype.itemsize}")).tobytes()
        header[k] = {"dtype": _NP_TO_ST[a.dtype], "shape": list(a.shape),
                     "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)  # the format pads the header to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for raw in blobs:
            f.write(raw)
