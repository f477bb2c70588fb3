"""DraftWeights: expected shapes, random init, safetensors save/load (bit-exact per dtype),
dtype conversion, sharded checkpoints, and the errors for bad checkpoints."""
import json
import struct
import warnings

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from dflash_cupy.config import DraftConfig
from dflash_cupy.weights import CheckpointError, DraftWeights, expected_shapes, resolve_dtype

BF16 = np.dtype(ml_dtypes.bfloat16)


def small_config(**kw):
    base = dict(n_layer=2, hidden_size=24, n_head=4, n_head_kv=2, head_dim=6,
                intermediate_size=40, block_size=4, target_layer_ids=(0, 2, 5),
                num_target_layers=6, mask_token_id=7)
    base.update(kw)
    return DraftConfig(**base)


def bits(a):
    return np.ascontiguousarray(a).view(np.dtype(f"u{a.dtype.itemsize}"))


def assert_bit_equal(w1, w2):
    assert set(w1.keys()) == set(w2.keys())
    for k in w1.keys():
        a, b = w1[k], w2[k]
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert np.array_equal(bits(a), bits(b)), k


def test_expected_shapes_base():
    c = small_config()
    s = expected_shapes(c)
    H, d = 24, 6
    assert s["fc.weight"] == (H, 3 * H)
    assert s["hidden_norm.weight"] == (H,) and s["norm.weight"] == (H,)
    assert s["layers.1.self_attn.q_proj.weight"] == (4 * d, H)
    assert s["layers.1.self_attn.k_proj.weight"] == (2 * d, H)
    assert s["layers.1.self_attn.v_proj.weight"] == (2 * d, H)
    assert s["layers.1.self_attn.o_proj.weight"] == (H, 4 * d)
    assert s["layers.0.self_attn.q_norm.weight"] == (d,)
    assert s["layers.0.self_attn.k_norm.weight"] == (d,)
    assert s["layers.0.mlp.gate_proj.weight"] == (40, H)
    assert s["layers.0.mlp.up_proj.weight"] == (40, H)
    assert s["layers.0.mlp.down_proj.weight"] == (H, 40)
    assert s["layers.1.input_layernorm.weight"] == (H,)
    assert s["layers.1.post_attention_layernorm.weight"] == (H,)
    assert len(s) == 3 + 2 * 11
    assert not any("aux" in k or "self_attn.gate_proj" in k for k in s)


def test_expected_shapes_variants():
    s = expected_shapes(small_config(aux_hidden_norms=True, attn_gate="head"))
    assert [s[f"aux_hidden_norms.{j}.weight"] for j in range(3)] == [(24,)] * 3
    assert s["layers.0.self_attn.gate_proj.weight"] == (4, 24)
    s = expected_shapes(small_config(attn_gate="element", context_kv_layer_norm=True))
    assert s["layers.1.self_attn.gate_proj.weight"] == (4 * 6, 24)
    assert len(s) == 3 + 2 * 12  # ctx-kv layernorm reuses input_layernorm


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_random_init(dtype):
    c = small_config(aux_hidden_norms=True, attn_gate="head")
    w = DraftWeights.random(c, seed=3, dtype=dtype)
    assert w.dtype == resolve_dtype(dtype)
    assert w.dtype_summary() == f"{dtype} x {len(expected_shapes(c))}"
    for name, shape in expected_shapes(c).items():
        a = w[name].astype(np.float64)
        assert a.shape == shape
        if "norm" in name:
            assert 0.8 - 1e-2 <= a.min() and a.max() <= 1.2 + 1e-2, name
            assert a.std() > 0.05, name  # not all ones
        else:
            std = a.std() * np.sqrt(shape[1])
            assert 0.7 < std < 1.3, (name, std)
    again = DraftWeights.random(c, seed=3, dtype=dtype)
    assert_bit_equal(w, again)
    other = DraftWeights.random(c, seed=4, dtype=dtype)
    assert not np.array_equal(w["fc.weight"], other["fc.weight"])


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_save_load_bit_exact(dtype, tmp_path):
    c = small_config(attn_gate="element", aux_hidden_norms=True,
                     layer_sliding=(True, False), sliding_window=5)
    w = DraftWeights.random(c, seed=11, dtype=dtype)
    w.save_pretrained(tmp_path)
    assert (tmp_path / "config.json").is_file() and (tmp_path / "model.safetensors").is_file()
    w2 = DraftWeights.from_pretrained(tmp_path)
    assert w2.config == c
    assert w2.dtype == w.dtype
    assert_bit_equal(w, w2)


def test_mixed_dtypes_kept_as_stored(tmp_path):
    c = small_config()
    w = DraftWeights.random(c, seed=1, dtype="bf16")
    tensors = dict(w.tensors)
    tensors["norm.weight"] = tensors["norm.weight"].astype(np.float32)
    tensors["fc.weight"] = tensors["fc.weight"].astype(np.float16)
    w = DraftWeights(c, tensors)
    assert w.dtype is None
    assert w.dtype_summary() == f"bf16 x {len(tensors) - 2}, f16 x 1, f32 x 1"
    w.save_pretrained(tmp_path)
    w2 = DraftWeights.from_pretrained(tmp_path)
    assert w2["norm.weight"].dtype == np.float32 and w2["fc.weight"].dtype == np.float16
    assert_bit_equal(w, w2)


@pytest.mark.parametrize("src,dst", [("f32", "bf16"), ("f32", "f16"), ("bf16", "f32"),
                                     ("f16", "bf16"), ("bf16", "f16")])
def test_load_with_dtype_converts(src, dst, tmp_path):
    w = DraftWeights.random(small_config(), seed=2, dtype=src)
    w.save_pretrained(tmp_path)
    for spec in (dst, resolve_dtype(dst).type):
        w2 = DraftWeights.from_pretrained(tmp_path, dtype=spec)
        assert w2.dtype == resolve_dtype(dst)
        for k in w.keys():
            # one round-to-nearest-even from the stored values (f16 -> f32 is exact)
            ref = w[k].astype(np.float32).astype(resolve_dtype(dst))
            assert np.array_equal(bits(w2[k]), bits(ref)), k
    assert_bit_equal(w.astype(dst), DraftWeights.from_pretrained(tmp_path, dtype=dst))


def test_bf16_values_survive_exactly(tmp_path):
    # every finite bf16 bit pattern class: subnormals, extremes, negative zero
    c = small_config(hidden_size=24)
    w = DraftWeights.random(c, seed=0, dtype="bf16")
    patterns = np.array([0x0000, 0x8000, 0x0001, 0x807F, 0x7F7F, 0xFF7F, 0x3F80, 0x3F81],
                        dtype=np.uint16)
    fc = bits(w["fc.weight"]).copy()
    fc.reshape(-1)[:patterns.size] = patterns
    tensors = dict(w.tensors, **{"fc.weight": fc.view(BF16)})
    DraftWeights(c, tensors).save_pretrained(tmp_path)
    got = DraftWeights.from_pretrained(tmp_path)["fc.weight"]
    assert np.array_equal(bits(got).reshape(-1)[:patterns.size], patterns)


def _write_sharded(tmp_path, w, n_shards=3):
    names = sorted(w.keys())
    weight_map = {}
    for s in range(n_shards):
        fname = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {k: w[k] for k in names[s::n_shards]}
        save_file(part, str(tmp_path / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": w.nbytes}, "weight_map": weight_map}))
    w.config.save(tmp_path)


def test_sharded_index(tmp_path):
    w = DraftWeights.random(small_config(attn_gate="head"), seed=9, dtype="bf16")
    _write_sharded(tmp_path, w)
    w2 = DraftWeights.from_pretrained(tmp_path)
    assert_bit_equal(w, w2)
    # a shard named by the index but absent
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="index.json: shard 'model-00002-of-00003.*is missing"):
        DraftWeights.from_pretrained(tmp_path)


def _save_with(tmp_path, w, tensors):
    w.config.save(tmp_path)
    save_file(tensors, str(tmp_path / "model.safetensors"))


def test_missing_tensor(tmp_path):
    w = DraftWeights.random(small_config(), seed=0)
    t = dict(w.tensors)
    del t["layers.1.self_attn.k_norm.weight"]
    _save_with(tmp_path, w, t)
    with pytest.raises(CheckpointError, match=r"missing.*layers\.1\.self_attn\.k_norm\.weight \[6\]"):
        DraftWeights.from_pretrained(tmp_path)


def test_misshapen_tensor(tmp_path):
    w = DraftWeights.random(small_config(), seed=0)
    t = dict(w.tensors)
    t["layers.0.self_attn.v_proj.weight"] = np.zeros((24, 12), np.float32)  # transposed
    _save_with(tmp_path, w, t)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'layers\.0\.self_attn\.v_proj"
                                             r"\.weight.*\[24, 12\].*\[12, 24\]"):
        DraftWeights.from_pretrained(tmp_path)


def test_unexpected_tensor_strict_and_lenient(tmp_path):
    w = DraftWeights.random(small_config(), seed=0)
    t = dict(w.tensors)
    t["lm_head.weight"] = np.zeros((5, 24), np.float32)
    t["aux_hidden_norms.0.weight"] = np.ones(24, np.float32)  # config does not enable aux norms
    _save_with(tmp_path, w, t)
    with pytest.raises(ValueError, match=r"unexpected.*aux_hidden_norms\.0\.weight.*lm_head"):
        DraftWeights.from_pretrained(tmp_path)
    with pytest.warns(UserWarning, match=r"aux_hidden_norms\.0\.weight, lm_head\.weight"):
        w2 = DraftWeights.from_pretrained(tmp_path, strict=False)
    assert "lm_head.weight" not in w2
    assert_bit_equal(w, w2)


def test_missing_files_and_backend(tmp_path):
    w = DraftWeights.random(small_config(), seed=0)
    w.config.save(tmp_path)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        DraftWeights.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError):
        DraftWeights.from_pretrained(tmp_path / "absent")
    w.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="backend name 'nope'"):
        DraftWeights.from_pretrained(tmp_path, backend="nope")


def test_from_pretrained_places_weights_on_the_backend(tmp_path):
    w = DraftWeights.random(small_config(), seed=0, dtype="bf16")
    w.save_pretrained(tmp_path)
    w2 = DraftWeights.from_pretrained(tmp_path, backend="emulated")
    dw = w2.device("emulated")
    assert w2.device("emulated") is dw  # placed once, cached
    c = w2.config
    q = w2.layer(0, "self_attn.q_proj")
    k = w2.layer(0, "self_attn.k_proj")
    v = w2.layer(0, "self_attn.v_proj")
    fused = np.asarray(dw.layers[0].w_qkv)
    # bf16 weights travel as their bit patterns, fused [q; k; v]
    assert fused.dtype == np.uint16 and fused.shape == (c.q_dim + 2 * c.kv_dim, c.hidden_size)
    np.testing.assert_array_equal(fused, np.concatenate([q, k, v]).view(np.uint16))
    np.testing.assert_array_equal(np.asarray(dw.layers[0].w_kv), np.concatenate([k, v]).view(np.uint16))
    assert np.asarray(dw.norm).dtype == np.float32


def test_unsupported_stored_dtype(tmp_path):
    w = DraftWeights.random(small_config(), seed=0)
    t = dict(w.tensors)
    t["norm.weight"] = t["norm.weight"].astype(np.float64)
    _save_with(tmp_path, w, t)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'norm\.weight' has dtype F64"):
        DraftWeights.from_pretrained(tmp_path)


def test_constructor_checks_and_access():
    c = small_config()
    w = DraftWeights.random(c, seed=0)
    with pytest.raises(KeyError, match="nope"):
        w["nope"]
    assert w.layer(1, "self_attn.q_proj") is w["layers.1.self_attn.q_proj.weight"]
    assert len(w) == len(expected_shapes(c)) and "fc.weight" in w
    bad = dict(w.tensors, **{"norm.weight": np.ones(24, np.int32)})
    with pytest.raises(ValueError, match=r"norm\.weight.*int32"):
        DraftWeights(c, bad)
    with pytest.raises(TypeError, match="dtype='f64'"):
        w.astype("f64")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "DraftWeights(n_layer=2" in repr(w)


# ---------------------------------------------------------------- corrupt checkpoints
def _good_file(tmp_path):
    w = DraftWeights.random(small_config(), seed=0, dtype="bf16")
    w.save_pretrained(tmp_path)
    p = tmp_path / "model.safetensors"
    return w, p, p.read_bytes()


def _file_with_header(header: dict, data: bytes) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def _header(raw: bytes) -> dict:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n])


CORRUPT = {
    "empty": (lambda raw: b"", "header too small"),
    "4 bytes": (lambda raw: raw[:4], "header too small"),
    "truncated header": (lambda raw: raw[:40], "invalid header length|header"),
    "header not JSON": (lambda raw: struct.pack("<Q", 5) + b"hello", "JSON"),
    "header length 2^40": (lambda raw: struct.pack("<Q", 2**40) + raw[8:], "header too large"),
    "random bytes": (lambda raw: np.random.default_rng(3).integers(0, 256, 400, dtype=np.uint8)
                     .tobytes(), "deserializing header"),
    "truncated data": (lambda raw: raw[:-7], "not fully covered|offset"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupt_file_raises_checkpoint_error_naming_it(tmp_path, case):
    _, p, raw = _good_file(tmp_path)
    corrupt, why = CORRUPT[case]
    p.write_bytes(corrupt(raw))
    with pytest.raises(CheckpointError, match=why) as ei:
        DraftWeights.from_pretrained(tmp_path)
    assert str(p) in str(ei.value)


def _tamper(tmp_path, edit):
    """Rewrite the first two tensors' header entries with ``edit(header, a, b)``."""
    _, p, raw = _good_file(tmp_path)
    h = _header(raw)
    data = raw[8 + struct.unpack("<Q", raw[:8])[0]:]
    names = sorted(k for k in h if k != "__metadata__")
    data = edit(h, names[0], names[1], data)
    p.write_bytes(_file_with_header(h, data))
    return p


def _past_the_end(h, a, b, data):
    s, e = h[a]["data_offsets"]
    h[a]["data_offsets"] = [s, e + 10 * len(data)]
    return data


def _overlapping(h, a, b, data):
    keep = {k: h[k] for k in (a, b)}
    h.clear()
    h.update(keep)
    na = keep[a]["data_offsets"][1] - keep[a]["data_offsets"][0]
    nb = keep[b]["data_offsets"][1] - keep[b]["data_offsets"][0]
    h[a]["data_offsets"] = [0, na]
    h[b]["data_offsets"] = [na - 2, na - 2 + nb]   # b's bytes start inside a's
    return bytes(na - 2 + nb)


def _shape_too_big(h, a, b, data):
    h[a]["shape"] = [x + 1 for x in h[a]["shape"]]
    return data


def _dtype_wider(h, a, b, data):
    h[a]["dtype"] = "F32"  # bf16 bytes declared as f32: half the elements the shape needs
    return data


@pytest.mark.parametrize("edit,why", [(_past_the_end, "offset"), (_overlapping, "offset"),
                                      (_shape_too_big, "shape, data type, or offset"),
                                      (_dtype_wider, "shape, data type, or offset")])
def test_tampered_header(tmp_path, edit, why):
    p = _tamper(tmp_path, edit)
    with pytest.raises(CheckpointError, match=why) as ei:
        DraftWeights.from_pretrained(tmp_path)
    assert str(p) in str(ei.value)


def test_index_not_json_and_tensor_in_the_wrong_shard(tmp_path):
    w = DraftWeights.random(small_config(), seed=9, dtype="bf16")
    _write_sharded(tmp_path, w)
    index = tmp_path / "model.safetensors.index.json"
    good = json.loads(index.read_text())
    index.write_text("{not json")
    with pytest.raises(CheckpointError, match="index.json: not a JSON index"):
        DraftWeights.from_pretrained(tmp_path)
    moved = dict(good["weight_map"])
    name = sorted(moved)[0]
    other = next(f for f in set(moved.values()) if f != moved[name])
    moved[name] = other
    index.write_text(json.dumps({"weight_map": moved}))
    with pytest.raises(CheckpointError, match=f"holds tensor '{name}'"):
        DraftWeights.from_pretrained(tmp_path)


# ---------------------------------------------------------------- immutability
def test_tensors_refuse_edits_after_construction():
    """A placed copy never goes stale: the mapping and the arrays are read-only."""
    w = DraftWeights.random(small_config(), seed=0)
    dw = w.device("emulated")
    with pytest.raises(TypeError):
        w.tensors["norm.weight"] = np.zeros(24, np.float32)
    with pytest.raises(ValueError, match="read-only"):
        w["norm.weight"][0] = 5.0
    with pytest.raises(ValueError, match="read-only"):
        w.layer(0, "self_attn.q_proj")[:] = 0
    assert w.device("emulated") is dw
    # the documented way: a new DraftWeights, placed afresh
    t = dict(w.tensors)
    t["norm.weight"] = np.full(24, 2.0, np.float32)
    w2 = DraftWeights(w.config, t)
    np.testing.assert_array_equal(np.asarray(w2.device("emulated").norm), t["norm.weight"])
    assert float(np.asarray(w.device("emulated").norm)[0]) != 2.0


def test_caller_arrays_stay_writable():
    w = DraftWeights.random(small_config(), seed=0)
    t = {k: np.array(v) for k, v in w.tensors.items()}
    DraftWeights(w.config, t)
    t["norm.weight"][0] = 1.0  # the caller's own array is not frozen


def test_device_only_weights():
    from profiling.common import RandomDraftWeights
    c = small_config()
    rw = RandomDraftWeights(c, "emulated", seed=1)
    assert len(rw) == 0 and rw.config is c
    assert rw.device("emulated").nbytes == rw.nbytes > 0
    assert "on emulated" in repr(rw)
    with pytest.raises(ValueError, match="cannot be saved"):
        rw.save_pretrained("/nonexistent")
    with pytest.raises(ValueError, match="placed weights take no host tensors"):
        DraftWeights(c, {"fc.weight": np.zeros(1)}, placed={"emulated": object()})
