"""DFlash 2 drafters on the host (SPEC §6): the config (parse, refusals, round trip), the
checkpoint layout (every tensor missing or misshaped), and the float64 oracle's
convolution and candidate selector against the independent loop reference in
tests/support/dflash2_reference.py, at awkward sizes, with ties, greedy and sampled
(same uniforms; chi-square). NumPy only: no kernel runs here."""
import copy
import json
import math

import ml_dtypes
import numpy as np
import pytest

from dflash_cupy import reference as ref
from dflash_cupy.config import DFlash2Config, DraftConfig
from dflash_cupy.mask_rule import MaskRule
from dflash_cupy.weights import CheckpointError, DraftWeights, expected_shapes
from tests.support import dflash2_reference as ind


# ------------------------------------------------------------------ config
def zlab_dflash2():
    """Laid out like z-lab's published DFlash 2 config.json (tests/fixtures/dflash2-config.json
    of z-lab/dflash: hidden 6656, 5 sliding layers, 202048 tokens)."""
    return {
        "architectures": ["DFlash2DraftModel"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 200000, "is_causal": False,
        "dflash_config": {"block_size": 16, "conv_group_size": 16, "conv_kernel_size": 2,
                          "final_logit_softcapping": 20.0, "mask_token_id": 201818,
                          "output_multiplier": 0.19611613513818404, "selector_rank": 256,
                          "selector_top_k": 16, "target_layer_ids": [1, 13, 25, 37, 49]},
        "dtype": "bfloat16", "eos_token_id": 200001, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 6656, "initializer_range": 0.02, "intermediate_size": 19968,
        "layer_types": ["sliding_attention"] * 5, "max_position_embeddings": 131072,
        "max_window_layers": 5, "model_type": "qwen3", "num_attention_heads": 32,
        "num_hidden_layers": 5, "num_key_value_heads": 8, "num_target_layers": 52,
        "pad_token_id": 200018, "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
        "sliding_window": 2048, "tie_word_embeddings": False, "transformers_version": "5.15.0",
        "use_cache": False, "use_sliding_window": True, "vocab_size": 202048,
    }


def test_published_config_parses():
    c = DraftConfig.from_hf(zlab_dflash2())
    d2 = c.dflash2
    assert c.architecture == "DFlash2DraftModel"
    assert (d2.conv_kernel_size, d2.conv_group_size, d2.selector_rank, d2.selector_top_k) \
        == (2, 16, 256, 16)
    assert d2.vocab_size == 202048 and d2.final_logit_softcapping == 20.0
    assert d2.output_multiplier == 0.19611613513818404 and d2.input_embedding_scale == 1.0
    assert d2.n_groups(c.hidden_size) == 416 and d2.projection_rows(c.hidden_size) == 1664
    assert (c.block_size, c.mask_token_id, c.target_layer_ids) == (16, 201818, (1, 13, 25, 37, 49))
    assert c.layer_sliding == (True,) * 5 and c.sliding_window == 2048
    # the published checkpoint's kernel_projection is [1664, 6656]
    shapes = expected_shapes(c)
    assert shapes["layers.0.attention_conv.kernel_projection.weight"] == (1664, 6656)
    assert shapes["layers.4.mlp_conv.base_kernel"] == (2, 2, 6656)
    assert shapes["candidate_selector.predecessor_codebook"] == (202048, 256)
    assert "vocab_size" not in c.extra and "architectures" not in c.extra
    # the published config's bidirectional sliding window (SPEC §6): the per-row rule, not causal
    assert c.is_causal is False and "is_causal" not in c.extra
    assert c.mask_rule == MaskRule(2048, per_row=True, causal_full=False, causal_sliding=False)


def test_dflash_config_is_dflash2_free():
    d = zlab_dflash2()
    d["architectures"] = ["DFlashDraftModel"]
    for k in ("conv_group_size", "conv_kernel_size", "final_logit_softcapping",
              "output_multiplier", "selector_rank", "selector_top_k"):
        d["dflash_config"].pop(k)
    c = DraftConfig.from_hf(d)
    assert c.dflash2 is None and c.architecture == "DFlashDraftModel"
    assert c.extra["vocab_size"] == 202048     # kept, as for any DFlash config
    assert c.to_hf()["architectures"] == ["DFlashDraftModel"]


def test_round_trip(tmp_path):
    d = zlab_dflash2()
    d["dflash_config"]["input_embedding_scale"] = 2.5
    c = DraftConfig.from_hf(d)
    out = c.to_hf()
    assert out["architectures"] == ["DFlash2DraftModel"] and out["vocab_size"] == 202048
    assert out["dflash_config"]["conv_group_size"] == 16
    assert out["dflash_config"]["input_embedding_scale"] == 2.5
    assert DraftConfig.from_hf(out) == c and hash(DraftConfig.from_hf(out)) == hash(c)
    c.save(tmp_path)
    assert DraftConfig.from_hf(tmp_path) == c
    assert c != c.replace(dflash2=None) and hash(c) != hash(c.replace(dflash2=None))


def test_optional_fields_and_top_level_fields():
    d = zlab_dflash2()
    dc = d["dflash_config"]
    dc.pop("output_multiplier")
    dc["final_logit_softcapping"] = 0            # 0: no softcap (z-lab, vLLM)
    d["selector_rank"] = dc.pop("selector_rank")  # z-lab reads dflash_config, then the top level
    c = DraftConfig.from_hf(d)
    assert c.dflash2.output_multiplier == 1.0 and c.dflash2.final_logit_softcapping is None
    assert c.dflash2.selector_rank == 256
    assert DraftConfig.from_hf(c.to_hf()) == c


def _mutated(edit):
    d = copy.deepcopy(zlab_dflash2())
    edit(d)
    return d


REFUSED = [
    # (what, edit, text the error must contain)
    ("other architecture", lambda d: d.update(architectures=["Qwen3ForCausalLM"]), "Qwen3ForCausalLM"),
    ("architectures as a string", lambda d: d.update(architectures="DFlash2DraftModel"), "one-entry list"),
    ("two architectures", lambda d: d.update(architectures=["DFlash2DraftModel"] * 2), "one-entry list"),
    ("unknown dflash_config key", lambda d: d["dflash_config"].update(selector_search_mode="global"),
     "selector_search_mode"),
    ("DFlash 2 fields in a DFlash config", lambda d: d.update(architectures=["DFlashDraftModel"]),
     "conv_group_size"),
    ("DFlash 2 field at the top of a DFlash config",
     lambda d: (d.update(architectures=["DFlashDraftModel"], conv_kernel_size=2),
                [d["dflash_config"].pop(k) for k in ("conv_group_size", "conv_kernel_size",
                 "final_logit_softcapping", "output_multiplier", "selector_rank", "selector_top_k")]),
     "conv_kernel_size"),
    ("missing conv_kernel_size", lambda d: d["dflash_config"].pop("conv_kernel_size"), "conv_kernel_size"),
    ("missing conv_group_size", lambda d: d["dflash_config"].pop("conv_group_size"), "conv_group_size"),
    ("missing selector_rank", lambda d: d["dflash_config"].pop("selector_rank"), "selector_rank"),
    ("missing selector_top_k", lambda d: d["dflash_config"].pop("selector_top_k"), "selector_top_k"),
    ("missing vocab_size", lambda d: d.pop("vocab_size"), "vocab_size"),
    ("group not dividing hidden", lambda d: d["dflash_config"].update(conv_group_size=15), "conv_group_size=15"),
    ("top_k above vocab", lambda d: d.update(vocab_size=10) or d["dflash_config"].update(mask_token_id=3),
     "selector_top_k"),
    ("zero taps", lambda d: d["dflash_config"].update(conv_kernel_size=0), "conv_kernel_size"),
    ("bool rank", lambda d: d["dflash_config"].update(selector_rank=True), "selector_rank"),
    ("negative softcap", lambda d: d["dflash_config"].update(final_logit_softcapping=-1.0),
     "final_logit_softcapping"),
    ("zero multiplier", lambda d: d["dflash_config"].update(output_multiplier=0.0), "output_multiplier"),
    ("nan scale", lambda d: d["dflash_config"].update(input_embedding_scale=float("nan")),
     "input_embedding_scale"),
    ("conflict top vs dflash_config", lambda d: d.update(selector_top_k=8), "selector_top_k"),
    ("mask token outside vocab", lambda d: d["dflash_config"].update(mask_token_id=202048), "mask_token_id"),
    ("no mask token", lambda d: d["dflash_config"].pop("mask_token_id"), "mask_token_id"),
]


@pytest.mark.parametrize("edit,needle", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_refused_with_the_field_named(edit, needle):
    with pytest.raises(ValueError) as ei:
        DraftConfig.from_hf(_mutated(edit))
    assert needle in str(ei.value), str(ei.value)


def test_unknown_dflash_config_key_refused_for_dflash_too():
    d = zlab_dflash2()
    d["architectures"] = ["DFlashDraftModel"]
    d["dflash_config"] = {"mask_token_id": 5, "target_layer_ids": [1, 2], "some_new_knob": 1}
    with pytest.raises(ValueError, match="some_new_knob"):
        DraftConfig.from_hf(d)


def test_direct_construction_checks():
    with pytest.raises(ValueError, match="selector_top_k"):
        DFlash2Config(conv_kernel_size=2, conv_group_size=4, selector_rank=3, selector_top_k=20,
                      vocab_size=19)
    base = dict(n_layer=1, hidden_size=12, n_head=2, n_head_kv=1, head_dim=6, intermediate_size=8,
                block_size=3, target_layer_ids=(0,), mask_token_id=2)
    d2 = DFlash2Config(conv_kernel_size=2, conv_group_size=5, selector_rank=3, selector_top_k=4,
                       vocab_size=19)
    with pytest.raises(ValueError, match="does not divide hidden_size=12"):
        DraftConfig(**base, dflash2=d2)
    with pytest.raises(ValueError, match="dflash2"):
        DraftConfig(**base, dflash2={"conv_kernel_size": 2})


# ------------------------------------------------------------------ weights
def tiny(vocab=19, top_k=4, taps=2, q_len=3, rank=5, n_layer=2, softcap=3.0, mult=0.7, scale=1.0):
    """H = 12 in 3 groups of 4 channels; 2 query heads on 1 kv head of dim 6."""
    d2 = DFlash2Config(conv_kernel_size=taps, conv_group_size=4, selector_rank=rank,
                       selector_top_k=top_k, vocab_size=vocab, final_logit_softcapping=softcap,
                       output_multiplier=mult, input_embedding_scale=scale)
    return DraftConfig(n_layer=n_layer, hidden_size=12, n_head=2, n_head_kv=1, head_dim=6,
                       intermediate_size=10, block_size=q_len, target_layer_ids=(0, 3),
                       mask_token_id=vocab - 1, rope_theta=10000.0, dflash2=d2)


DFLASH2_NAMES = {
    "layers.1.attention_conv.base_kernel": (2, 2, 12),
    "layers.1.attention_conv.kernel_projection.weight": (12, 12),     # 2 * 2 taps * 3 groups
    "layers.0.mlp_conv.base_kernel": (2, 2, 12),
    "layers.0.mlp_conv.kernel_projection.weight": (12, 12),
    "candidate_selector.hidden_projection.weight": (5, 12),
    "candidate_selector.predecessor_codebook": (19, 5),
    "candidate_selector.successor_codebook": (19, 5),
}


def test_expected_shapes_add_exactly_the_dflash2_tensors():
    c = tiny()
    s, s1 = expected_shapes(c), expected_shapes(c.replace(dflash2=None))
    added = {k: v for k, v in s.items() if k not in s1}
    assert len(added) == 4 * c.n_layer + 3
    for name, shape in DFLASH2_NAMES.items():
        assert added[name] == shape, name
    assert all(s[k] == v for k, v in s1.items())
    assert expected_shapes(tiny(taps=3))["layers.0.mlp_conv.kernel_projection.weight"] == (18, 12)


def test_random_dflash2_weights():
    """Seeded; base kernels near the identity (tap 0 in [0.8, 1.2]) with every later tap
    non-zero, so a misplaced tap changes the output."""
    c = tiny()
    w, again = DraftWeights.random(c, seed=5), DraftWeights.random(c, seed=5)
    assert all(np.array_equal(w[k], again[k]) for k in w)
    assert not np.array_equal(w["candidate_selector.successor_codebook"],
                              DraftWeights.random(c, seed=6)["candidate_selector.successor_codebook"])
    bk = w["layers.0.attention_conv.base_kernel"]
    assert (0.8 <= bk[:, 0]).all() and (bk[:, 0] <= 1.2).all() and np.abs(bk[:, 1]).max() > 0.05


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_save_load_bit_exact(dtype, tmp_path):
    w = DraftWeights.random(tiny(), seed=2, dtype=dtype)
    w.save_pretrained(tmp_path)
    back = DraftWeights.from_pretrained(tmp_path)
    assert back.config == w.config and set(back) == set(w)
    for k in w:
        a, b = w[k], back[k]
        assert a.dtype == b.dtype and np.array_equal(a.view(f"u{a.dtype.itemsize}"),
                                                     b.view(f"u{b.dtype.itemsize}")), k
    if dtype == "bf16":
        assert back["candidate_selector.predecessor_codebook"].dtype == ml_dtypes.bfloat16


def _write(tmp_path, w, tensors):
    from safetensors.numpy import save_file
    w.config.save(tmp_path)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
              str(tmp_path / "model.safetensors"))


@pytest.mark.parametrize("name", list(DFLASH2_NAMES))
def test_missing_tensor_named(name, tmp_path):
    w = DraftWeights.random(tiny(), seed=0, dtype="bf16")
    t = dict(w.tensors)
    del t[name]
    _write(tmp_path, w, t)
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        DraftWeights.from_pretrained(tmp_path)


@pytest.mark.parametrize("name", list(DFLASH2_NAMES))
def test_misshaped_tensor_named(name, tmp_path):
    w = DraftWeights.random(tiny(), seed=0, dtype="f16")
    t = dict(w.tensors)
    t[name] = np.concatenate([t[name], t[name][:1]])          # one row too many
    _write(tmp_path, w, t)
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.") + ".*expected"):
        DraftWeights.from_pretrained(tmp_path)


def test_dflash_checkpoint_with_dflash2_tensors_is_refused(tmp_path):
    """A DFlash 2 checkpoint whose config lost its architecture does not load as DFlash."""
    w = DraftWeights.random(tiny(), seed=0)
    _write(tmp_path, w, dict(w.tensors))
    d = w.config.to_hf()
    d["architectures"] = ["DFlashDraftModel"]
    for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
              "final_logit_softcapping", "output_multiplier", "input_embedding_scale"):
        d["dflash_config"].pop(k)
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match="unexpected tensor.*attention_conv"):
        DraftWeights.from_pretrained(tmp_path)


def test_device_weights_hold_the_convolutions_and_the_selector():
    w = DraftWeights.random(tiny(), seed=0)
    dw = w.device("emulated")
    c, d2 = w.config, w.config.dflash2
    L = dw.layers[0]
    assert L.conv_a_kp.shape == L.conv_m_kp.shape == (d2.projection_rows(c.hidden_size), c.hidden_size)
    assert L.conv_a_base.shape == (2, d2.conv_kernel_size, c.hidden_size) and L.conv_a_base.dtype == np.float32
    assert dw.selector_hp.shape == (d2.selector_rank, c.hidden_size)
    assert dw.selector_pred.shape == dw.selector_succ.shape == (d2.vocab_size, d2.selector_rank)


# ------------------------------------------------------------------ the oracle: convolution
@pytest.mark.parametrize("B,taps", [(1, 2), (3, 2), (3, 3), (2, 4), (5, 2)])
def test_grouped_conv_matches_the_loop_reference(B, taps):
    rng = np.random.default_rng(B * 10 + taps)
    H, gs = 12, 4
    G = H // gs
    x = rng.standard_normal((B, H))
    base = rng.standard_normal((2, taps, H))
    raw = rng.standard_normal((B, 2 * taps * G))           # kernel_projection output rows
    delta = raw.reshape(B, 2, taps, G)
    for half in (0, 1):
        got = ref.grouped_conv(x, base[half], delta[:, half], gs)
        want = ind.conv_rows(x, base[half], raw, half, taps, gs)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-13)
    # row 0 sees only tap 0: nothing before the block
    np.testing.assert_allclose(got[0], (base[1, 0] + np.repeat(delta[0, 1, 0], gs)) * x[0], atol=1e-14)


def _forward_inputs(c, C=4, seed=0):
    rng = np.random.default_rng(seed)
    B = c.q_len
    X = rng.standard_normal((C, c.fc_in))
    E = rng.standard_normal((B, c.hidden_size))
    pos_ctx, pos_noise = 100 + np.arange(C), 100 + C + np.arange(B)
    # explicit masks, so these tests do not depend on the mask rule: layer 0 sees all,
    # layer 1 a per-row pattern (context 1.. and noise rows up to its own)
    vis0 = np.ones((B, C + B), bool)
    vis1 = np.zeros((B, C + B), bool)
    for i in range(B):
        vis1[i, 1 + (i % 2):C] = True
        vis1[i, C:C + i + 1] = True
    return X, E, pos_ctx, pos_noise, [vis0, vis1]


@pytest.mark.parametrize("q_len,taps", [(1, 2), (3, 2), (4, 3)])
def test_forward_matches_the_loop_reference(q_len, taps):
    c = tiny(q_len=q_len, taps=taps)
    w = DraftWeights.random(c, seed=q_len, dtype="bf16")
    X, E, pc, pn, vis = _forward_inputs(c, seed=q_len)
    got = ref.draft_forward_positions(w, X, E, pc, pn, visible=vis)
    want = ind.forward(dict(w.tensors), c, X, E, pc, pn, vis)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-11)


def test_identity_convolution_is_the_dflash_forward():
    """base = (1, 0, ...) on both sides and a zero projection: the DFlash 2 forward equals
    the DFlash one of the same backbone (the hooks change nothing else); any tap moves it."""
    c = tiny(q_len=3)
    w = DraftWeights.random(c, seed=1)
    t = dict(w.tensors)
    for name in list(t):
        if name.endswith("base_kernel"):
            b = np.zeros(t[name].shape, np.float32)
            b[:, 0] = 1.0
            t[name] = b
        elif name.endswith("kernel_projection.weight"):
            t[name] = np.zeros(t[name].shape, np.float32)
    ident = DraftWeights(c, t)
    v1 = DraftWeights(c.replace(dflash2=None), {k: a for k, a in t.items()
                                                if k in expected_shapes(c.replace(dflash2=None))})
    X, E, pc, pn, vis = _forward_inputs(c)
    h2 = ref.draft_forward_positions(ident, X, E, pc, pn, visible=vis)
    h1 = ref.draft_forward_positions(v1, X, E, pc, pn, visible=vis)
    np.testing.assert_array_equal(h2, h1)
    t["layers.1.mlp_conv.base_kernel"] = t["layers.1.mlp_conv.base_kernel"].copy()
    t["layers.1.mlp_conv.base_kernel"][1, 1, 5] = 0.5        # one after-tap of one channel
    moved = ref.draft_forward_positions(DraftWeights(c, t), X, E, pc, pn, visible=vis)
    np.testing.assert_array_equal(moved[0], h1[0])           # row 0 has no predecessor
    assert np.abs(moved[1:] - h1[1:]).max() > 1e-3


def test_noise_embedding_scale():
    c = tiny(scale=2.5, q_len=4)
    table = np.random.default_rng(0).standard_normal((19, 12)).astype(np.float32)
    e = ref.noise_embedding(table, 3, c)
    np.testing.assert_array_equal(e, np.float64(table[[3, 18, 18, 18]]) * 2.5)
    np.testing.assert_array_equal(ref.noise_embedding(table, 3, c.replace(dflash2=None)),
                                  np.float64(table[[3, 18, 18, 18]]))
    with pytest.raises(ValueError, match="anchor=19"):
        ref.noise_embedding(table, 19, c)


# ------------------------------------------------------------------ the oracle: selector
def _block(c, seed):
    rng = np.random.default_rng(seed)
    w = DraftWeights.random(c, seed=seed)
    hidden = rng.standard_normal((c.q_len, c.hidden_size))
    lm_head = rng.standard_normal((c.dflash2.vocab_size, c.hidden_size)) / math.sqrt(c.hidden_size) * 4
    return w, hidden, lm_head


def _check_against_independent(c, w, hidden, lm_head, anchor, T=0.0, u=None):
    got = ref.select_draft(w, hidden, lm_head, anchor, temperature=T, uniforms=u)
    tokens, ids, vals, q = ind.select(dict(w.tensors), c, hidden, lm_head, anchor, T, u)
    R, K = c.q_len - 1, c.dflash2.selector_top_k
    assert got.candidate_ids.shape == (R, K) and got.q.shape == (R, K)
    assert got.candidate_ids.tolist() == ids
    assert got.draft_tokens.tolist() == tokens
    if R:
        np.testing.assert_allclose(got.candidate_values, vals, rtol=0, atol=1e-12)
        np.testing.assert_allclose(got.q, q, rtol=0, atol=1e-12)
    return got


@pytest.mark.parametrize("vocab,top_k,q_len", [(19, 4, 3), (33, 5, 5), (19, 1, 3), (19, 19, 4),
                                               (33, 16, 1), (33, 3, 2)])
def test_greedy_walk_matches_the_loop_reference(vocab, top_k, q_len):
    c = tiny(vocab=vocab, top_k=top_k, q_len=q_len)
    w, hidden, lm_head = _block(c, seed=vocab + top_k + q_len)
    got = _check_against_independent(c, w, hidden, lm_head, anchor=vocab // 2)
    assert (got.margin > 0).all()                      # random data: no exact tie
    if q_len > 1 and top_k > 1:
        # the selector is not the per-row argmax everywhere (the edge term matters)
        flips = [_check_against_independent(tiny(vocab=vocab, top_k=top_k, q_len=q_len),
                                            *_block(c, s), anchor=1).choice.any()
                 for s in range(8)]
        assert any(flips)


@pytest.mark.parametrize("softcap", [3.0, None])
def test_softcap_and_multiplier_apply_to_the_raw_top_k(softcap):
    c = tiny(softcap=softcap, mult=0.7)
    w, hidden, lm_head = _block(c, seed=4)
    got = ref.select_draft(w, hidden, lm_head, 0)
    raw = np.sort(hidden[1:] @ lm_head.T, axis=1)[:, ::-1][:, :4]
    want = raw * 0.7 if softcap is None else np.tanh(raw * 0.7 / 3.0) * 3.0
    np.testing.assert_allclose(got.candidate_values, want, rtol=0, atol=1e-13)


def test_logit_ties_go_to_the_lowest_id():
    c = tiny(vocab=19, top_k=4, q_len=3)
    w, hidden, lm_head = _block(c, seed=9)
    # tokens 11, 4, 16 share token 2's head row: equal logits; 2 ranks highest
    lm_head[2] = hidden[1] * 5
    for v in (11, 4, 16):
        lm_head[v] = lm_head[2]
    got = _check_against_independent(c, w, hidden, lm_head, anchor=0)
    assert got.candidate_ids[0].tolist() == [2, 4, 11, 16]


def test_score_ties_take_the_first_candidate():
    """Zero codebooks and a flat head: every edge score of a row is equal, the walk takes
    candidate 0, the lowest id; with the unary term alone, the walk is the argmax."""
    c = tiny(vocab=19, top_k=5, q_len=4)
    w, hidden, _ = _block(c, seed=3)
    t = dict(w.tensors)
    t["candidate_selector.successor_codebook"] = np.zeros((19, 5), np.float32)
    w0 = DraftWeights(c, t)
    flat = np.zeros((19, 12))
    got = _check_against_independent(c, w0, hidden, flat, anchor=7)
    assert got.choice.tolist() == [0, 0, 0] and got.draft_tokens.tolist() == [0, 0, 0]
    assert (got.margin == 0).all()
    lm = np.random.default_rng(2).standard_normal((19, 12))
    got = _check_against_independent(c, w0, hidden, lm, anchor=7)
    assert got.draft_tokens.tolist() == np.argmax(hidden[1:] @ lm.T, axis=1).tolist()


@pytest.mark.parametrize("T", [0.5, 1.0, 3.0])
def test_sampled_walk_matches_the_loop_reference(T):
    c = tiny(vocab=33, top_k=6, q_len=5)
    for seed in range(4):
        w, hidden, lm_head = _block(c, seed=seed)
        u = np.random.default_rng(100 + seed).random(4)
        got = _check_against_independent(c, w, hidden, lm_head, anchor=5, T=T, u=u)
        np.testing.assert_allclose(got.q.sum(axis=1), 1.0, atol=1e-12)
        # the row's q is softmax(scores / T) of the previous choice's row
        prev = np.r_[0, got.choice[:-1]]
        s = got.scores[np.arange(4), prev]
        np.testing.assert_allclose(got.q, np.exp(s / T) / np.exp(s / T).sum(1, keepdims=True),
                                   rtol=1e-12)


def _chi2_sf(x, df):
    """Upper tail of chi-square (Wilson-Hilferty), enough for a pass/fail threshold."""
    z = ((x / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_sampled_walk_chi_square():
    """Two rows of K = 3: the joint (row 1, row 2) frequencies over 30000 seeded walks
    match q1[j1] * q2[j2 | j1]; the same counts reject the distribution without the
    temperature (the test has teeth)."""
    rng = np.random.default_rng(7)
    scores = rng.standard_normal((2, 3, 3)) * 1.5
    T, N = 1.7, 30000
    counts = np.zeros((3, 3))
    for u in rng.random((N, 2)):
        ch, _, _ = ref.selector_walk(scores, T, u)
        counts[ch[0], ch[1]] += 1

    def joint(t):
        q1 = np.exp(scores[0, 0] / t) / np.exp(scores[0, 0] / t).sum()
        q2 = np.exp(scores[1] / t) / np.exp(scores[1] / t).sum(1, keepdims=True)
        return q1[:, None] * q2

    def p_value(expected):
        e = expected * N
        return _chi2_sf(float(((counts - e) ** 2 / e).sum()), 8)

    assert p_value(joint(T)) > 1e-3
    assert p_value(joint(1.0)) < 1e-6


def test_selector_bad_input():
    c = tiny()
    w, hidden, lm_head = _block(c, seed=0)
    with pytest.raises(ValueError, match="anchor=19"):
        ref.select_draft(w, hidden, lm_head, 19)
    with pytest.raises(ValueError, match="anchor=-1"):
        ref.select_draft(w, hidden, lm_head, -1)
    with pytest.raises(ValueError, match="uniforms"):
        ref.select_draft(w, hidden, lm_head, 0, temperature=1.0)
    with pytest.raises(ValueError, match="uniforms"):
        ref.select_draft(w, hidden, lm_head, 0, temperature=1.0, uniforms=[0.5, 1.0])
    with pytest.raises(ValueError, match="lm_head"):
        ref.select_draft(w, hidden, lm_head[:-1], 0)
    with pytest.raises(ValueError, match="temperature"):
        ref.select_draft(w, hidden, lm_head, 0, temperature=-1.0)
    one_row = ref.select_draft(w, hidden[:1], lm_head, 0, temperature=np.float32(0.5))
    assert one_row.draft_tokens.shape == (0,) and one_row.q.shape == (0, 4)
    bad = lm_head.copy()
    bad[3, 0] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        ref.select_draft(w, hidden, bad, 0)
    v1 = DraftWeights.random(c.replace(dflash2=None), seed=0)
    with pytest.raises(ValueError, match="no candidate selector"):
        ref.select_draft(v1, hidden, lm_head, 0)


@pytest.mark.parametrize("T", [0.0, 0.8])
def test_block_end_to_end_through_the_documented_api(T):
    """noise_embedding -> draft_forward_positions -> select_draft against the loop
    reference's forward and selector: hidden states, candidates and draft tokens."""
    c = tiny(vocab=33, top_k=5, q_len=4, scale=1.5)
    w = DraftWeights.random(c, seed=21, dtype="bf16")
    rng = np.random.default_rng(21)
    table = rng.standard_normal((33, 12))
    lm_head = rng.standard_normal((33, 12)) * 1.5
    X, _, pc, pn, vis = _forward_inputs(c, seed=21)
    E = ref.noise_embedding(table, 9, c)
    u = rng.random(3) if T else None
    hidden = ref.draft_forward_positions(w, X, E, pc, pn, visible=vis)
    want_hidden = ind.forward(dict(w.tensors), c, X, table[[9, 32, 32, 32]] * 1.5, pc, pn, vis)
    np.testing.assert_allclose(hidden, want_hidden, rtol=0, atol=1e-11)
    got = _check_against_independent(c, w, hidden, lm_head, 9, T, u)
    assert got.draft_tokens.dtype == np.int64 and got.candidate_ids.dtype == np.int64


def test_margin_is_the_distance_to_a_flip():
    """Sampled: moving a row's uniform by 0.99 margin keeps every choice, by 1.01 margin
    toward the nearer boundary flips that row. Greedy: best minus runner-up."""
    rng = np.random.default_rng(11)
    scores = rng.standard_normal((4, 5, 5))
    u = rng.random(4)
    ch, q, margin = ref.selector_walk(scores, 0.9, u)
    for r in range(4):
        cum = np.cumsum(q[r])
        lo = cum[ch[r] - 1] if ch[r] else 0.0
        toward = -1.0 if u[r] - lo < cum[ch[r]] - u[r] else 1.0
        for f, same in ((0.99, True), (1.01, False)):
            v = u.copy()
            v[r] += toward * f * margin[r]
            if 0 <= v[r] < 1:
                assert (ref.selector_walk(scores, 0.9, v)[0][r] == ch[r]) == same, (r, f)
    ch, _, margin = ref.selector_walk(scores, 0.0)
    prev = np.r_[0, ch[:-1]]
    for r in range(4):
        row = np.sort(scores[r, prev[r]])
        assert margin[r] == pytest.approx(row[-1] - row[-2], abs=1e-15)
