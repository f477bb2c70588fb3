"""DraftConfig: parsing real-layout DFlash config.json dicts, validation errors, round trip."""
import copy
import json

import pytest

from dflash_cupy.config import DraftConfig


def qwen3_8b_dflash():
    """Laid out like z-lab's Qwen3-8B DFlash drafter config.json (b16)."""
    return {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": 16,
        "bos_token_id": 151643,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
        "dtype": "bfloat16",
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 12288,
        "layer_types": ["full_attention"] * 5,
        "max_position_embeddings": 40960,
        "max_window_layers": 5,
        "model_type": "qwen3",
        "num_attention_heads": 32,
        "num_hidden_layers": 5,
        "num_key_value_heads": 8,
        "num_target_layers": 36,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }


def sliding_mix():
    """Newer z-lab layout: block_size inside dflash_config, rope_theta inside
    rope_parameters, mostly-sliding layers."""
    return {
        "model_type": "qwen3",
        "hidden_size": 2048,
        "num_hidden_layers": 6,
        "intermediate_size": 6144,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "num_target_layers": 41,
        "sliding_window": 4096,
        "dflash_config": {"block_size": 16, "mask_token_id": 248077,
                          "target_layer_ids": [1, 6, 11, 16, 22, 27, 32, 37]},
        "rope_parameters": {"rope_theta": 10_000_000.0, "rope_type": "default"},
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    }


def test_qwen3_8b_layout():
    c = DraftConfig.from_hf(qwen3_8b_dflash())
    assert (c.n_layer, c.hidden_size, c.n_head, c.n_head_kv, c.head_dim) == (5, 4096, 32, 8, 128)
    assert c.intermediate_size == 12288 and c.block_size == 16 and c.q_len == 16
    assert c.target_layer_ids == (1, 9, 17, 25, 33)
    assert c.n_captured == 5 and c.fc_in == 5 * 4096
    assert c.num_target_layers == 36
    assert c.mask_token_id == 151669
    assert c.rope_theta == 1e6 and isinstance(c.rope_theta, float)
    assert c.rope_scaling is None
    assert c.rms_norm_eps == 1e-6
    assert c.gqa_ratio == 4
    assert c.layer_sliding == (False,) * 5 and not c.any_sliding and c.any_full
    assert c.sliding_window is None and c.swa_window == 0
    assert (c.aux_hidden_norms, c.context_kv_layer_norm, c.attn_gate) == (False, False, "none")


def test_defaults_when_optional_fields_absent():
    d = qwen3_8b_dflash()
    for k in ("layer_types", "rms_norm_eps", "num_key_value_heads", "head_dim", "rope_theta",
              "sliding_window", "use_sliding_window", "max_window_layers"):
        d.pop(k)
    c = DraftConfig.from_hf(d)
    assert c.layer_sliding == (False,) * 5
    assert c.rms_norm_eps == 1e-6
    assert c.n_head_kv == 32 and c.head_dim == 4096 // 32
    assert c.rope_theta == 1e6


def test_float_rope_theta_and_one_layer():
    d = qwen3_8b_dflash()
    d.update(num_hidden_layers=1, layer_types=["full_attention"], rope_theta=5e5)
    c = DraftConfig.from_hf(d)
    assert c.n_layer == 1 and c.rope_theta == 500000.0


def test_sliding_mix_nested_layout():
    c = DraftConfig.from_hf(sliding_mix())
    assert c.layer_sliding == (True,) * 5 + (False,)
    assert c.layer_types[0] == "sliding_attention" and c.layer_types[5] == "full_attention"
    assert c.sliding_window == 4096 and c.swa_window == 4096
    assert c.block_size == 16 and c.rope_theta == 1e7 and c.rope_scaling is None
    assert c.n_captured == 8 and c.fc_in == 8 * 2048
    assert c.rms_norm_eps == 1e-5
    assert c.is_sliding(0) and not c.is_sliding(5)


@pytest.mark.parametrize("where", ["top", "dflash_config"])
def test_is_causal_and_window_rule(where):
    from dflash_cupy.mask_rule import MaskRule
    d = sliding_mix()
    c = DraftConfig.from_hf(d)
    # absent: sliding layers causal inside the block, full layers not; the per-row window
    assert c.is_causal is None and c.window_rule == "per_row"
    assert c.mask_rule == MaskRule(4096, per_row=True, causal_full=False, causal_sliding=True)
    (d if where == "top" else d["dflash_config"])["is_causal"] = False
    d["dflash_config"]["window_rule"] = "anchored"
    c = DraftConfig.from_hf(d)
    assert c.is_causal is False and c.window_rule == "anchored"
    assert c.mask_rule == MaskRule(4096, per_row=False, causal_full=False, causal_sliding=False)
    out = c.to_hf()
    assert out["is_causal"] is False and out["dflash_config"]["window_rule"] == "anchored"
    assert "is_causal" not in out["dflash_config"] and DraftConfig.from_hf(out) == c
    # the defaults are not written
    dflt = DraftConfig.from_hf(sliding_mix()).to_hf()
    assert "is_causal" not in dflt and "window_rule" not in dflt["dflash_config"]


def test_top_level_wins_over_dflash_config():
    d = sliding_mix()
    d["block_size"] = 8
    assert DraftConfig.from_hf(d).block_size == 8


def test_hf_rule_without_layer_types():
    d = qwen3_8b_dflash()
    d.pop("layer_types")
    d.update(use_sliding_window=True, sliding_window=512, max_window_layers=3)
    c = DraftConfig.from_hf(d)
    assert c.layer_sliding == (False, False, False, True, True)
    assert c.sliding_window == 512
    d["use_sliding_window"] = False  # HF drops the window when SWA is off
    c = DraftConfig.from_hf(d)
    assert c.layer_sliding == (False,) * 5 and c.sliding_window is None


def test_rope_scaling_yarn_and_linear():
    d = qwen3_8b_dflash()
    d["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 32768}
    c = DraftConfig.from_hf(d)
    assert c.rope_scaling == {"rope_type": "yarn", "factor": 4.0,
                              "original_max_position_embeddings": 32768}
    d["rope_scaling"] = {"type": "linear", "factor": 2}  # legacy key
    assert DraftConfig.from_hf(d).rope_scaling == {"rope_type": "linear", "factor": 2}
    d["rope_scaling"] = {"rope_type": "default"}
    assert DraftConfig.from_hf(d).rope_scaling is None
    d["rope_scaling"] = None
    d["rope_parameters"] = {"rope_type": "linear", "factor": 3.0, "rope_theta": 1e6}
    assert DraftConfig.from_hf(d).rope_scaling == {"rope_type": "linear", "factor": 3.0}


@pytest.mark.parametrize("where", ["top", "dflash_config"])
def test_variant_flags(where):
    d = qwen3_8b_dflash()
    flags = {"aux_hidden_norms": True, "context_kv_layer_norm": True, "attn_gate": "element"}
    (d if where == "top" else d["dflash_config"]).update(flags)
    c = DraftConfig.from_hf(d)
    assert (c.aux_hidden_norms, c.context_kv_layer_norm, c.attn_gate) == (True, True, "element")


def test_variant_flag_conflict():
    d = qwen3_8b_dflash()
    d["attn_gate"] = "head"
    d["dflash_config"]["attn_gate"] = "element"
    with pytest.raises(ValueError, match="attn_gate"):
        DraftConfig.from_hf(d)


def test_from_path_dir_and_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(sliding_mix()))
    assert DraftConfig.from_hf(tmp_path) == DraftConfig.from_hf(tmp_path / "config.json") \
        == DraftConfig.from_hf(sliding_mix())
    with pytest.raises(FileNotFoundError, match="config"):
        DraftConfig.from_hf(tmp_path / "nope")


@pytest.mark.parametrize("make", [qwen3_8b_dflash, sliding_mix])
def test_to_hf_round_trip(make, tmp_path):
    d = make()
    d["dflash_config"]["attn_gate"] = "head"
    d["rope_scaling"] = {"rope_type": "yarn", "factor": 2.0, "beta_fast": 16,
                         "original_max_position_embeddings": 2048}
    c = DraftConfig.from_hf(d)
    out = c.to_hf()
    assert DraftConfig.from_hf(out) == c
    c.save(tmp_path)
    assert DraftConfig.from_hf(tmp_path) == c
    assert out["rope_theta"] == int(c.rope_theta)  # integral theta written as an int
    assert out["dflash_config"]["target_layer_ids"] == list(c.target_layer_ids)
    # unknown keys survive a load/save
    assert out["model_type"] == "qwen3"
    if "vocab_size" in d:
        assert out["vocab_size"] == d["vocab_size"]
    assert hash(c) == hash(DraftConfig.from_hf(out))


# ----------------------------------------------------------------- malformed configs
def _mutate(base, path, value):
    d = copy.deepcopy(base())
    *parents, leaf = path
    node = d
    for p in parents:
        node = node[p]
    if value is _DELETE:
        del node[leaf]
    else:
        node[leaf] = value
    return d


_DELETE = object()

MALFORMED = [
    # (path in the dict, bad value, text the error must contain)
    (("num_attention_heads",), 30, "n_head"),               # 30 % 8 != 0
    (("head_dim",), 127, "head_dim"),
    (("layer_types",), ["full_attention"] * 4, "layer_types"),
    (("layer_types",), ["full_attention"] * 4 + ["local"], "layer_types"),
    (("hidden_size",), -4096, "hidden_size"),
    (("intermediate_size",), 0, "intermediate_size"),
    (("num_hidden_layers",), 2.5, "n_layer"),
    (("block_size",), _DELETE, "block_size"),
    (("dflash_config", "target_layer_ids"), _DELETE, "target_layer_ids"),
    (("dflash_config", "target_layer_ids"), [], "target_layer_ids"),
    (("num_target_layers",), 0, "num_target_layers"),
    (("dflash_config", "target_layer_ids"), [1, -2], "target_layer_ids"),
    (("dflash_config", "mask_token_id"), -1, "mask_token_id"),
    (("rope_scaling",), {"rope_type": "dynamic", "factor": 2.0}, "dynamic"),
    (("rope_scaling",), {"rope_type": "linear"}, "factor"),
    (("rope_scaling",), {"rope_type": "linear", "factor": -1.0}, "factor"),
    (("rope_scaling",), {"factor": 2.0}, "rope_type"),
    (("rope_theta",), 0, "rope_theta"),
    (("rms_norm_eps",), -1e-6, "rms_norm_eps"),
    (("sliding_window",), -3, "sliding_window"),
    (("hidden_act",), "gelu", "hidden_act"),
    (("attention_bias",), True, "attention_bias"),
    (("dflash_config", "attn_gate"), "channel", "attn_gate"),
    (("dflash_config", "aux_hidden_norms"), "yes", "aux_hidden_norms"),
    (("num_hidden_layers",), _DELETE, "num_hidden_layers"),
    (("is_causal",), "no", "is_causal"),
    (("dflash_config", "window_rule"), "sliding", "window_rule"),
]


@pytest.mark.parametrize("path,value,needle", MALFORMED,
                         ids=[f"{'.'.join(p)}={v if v is not _DELETE else 'missing'}"
                              for p, v, _ in MALFORMED])
def test_malformed_config_names_field(path, value, needle):
    d = _mutate(qwen3_8b_dflash, path, value)
    with pytest.raises(ValueError) as ei:
        DraftConfig.from_hf(d)
    msg = str(ei.value)
    assert needle in msg, msg
    if value is not _DELETE and not isinstance(value, (dict, list)):
        assert repr(value) in msg or str(value) in msg, msg  # names the bad value too


def test_yarn_needs_max_position_embeddings():
    d = qwen3_8b_dflash()
    d.pop("max_position_embeddings")
    d["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    with pytest.raises(ValueError, match="max_position_embeddings"):
        DraftConfig.from_hf(d)
    d["rope_scaling"]["original_max_position_embeddings"] = 32768
    assert DraftConfig.from_hf(d).rope_scaling["factor"] == 4.0


def test_direct_construction_and_replace():
    c = DraftConfig(n_layer=2, hidden_size=32, n_head=4, n_head_kv=2, head_dim=8,
                    intermediate_size=48, block_size=4, target_layer_ids=[3, 1])
    assert c.target_layer_ids == (3, 1) and c.layer_sliding == (False, False)
    c2 = c.replace(n_layer=3)
    assert c2.n_layer == 3 and c2.layer_sliding == (False,) * 3
    with pytest.raises(ValueError, match="layer_sliding"):
        c.replace(layer_sliding=(True,))
    with pytest.raises(ValueError, match="n_head_kv=3"):
        c.replace(n_head_kv=3)
    assert c.replace(sliding_window=0).sliding_window is None
