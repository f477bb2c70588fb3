"""profiling.calibrate: the model's estimated parameters fitted back from per-kernel times.

The "measured" run is synthesised from the model itself with known parameters (a slower
HBM, longer node gaps, a slower qkv epilogue), so the fit must recover them."""
import json

import pytest

from profiling import calibrate as cal
from profiling import perf_model as pm
from profiling.hw_params import H200, get_gpu

TRUTH = {"hbm_Bps": 0.88 * H200.hbm_Bps, "node_gap_s": 2.3e-6, "rope_round_clocks": 1100.0}


def _run(windows=(2048, 32768), backend="cuda", truth=TRUTH):
    """A bench_step document as gpu_check writes it, timed by the model under ``truth``."""
    gpu = H200.with_overrides(truth)
    rows = []
    for w in windows:
        m = pm.model_step("h4096", w, gpu, compiled=False)
        kernels = {label: e["predicted_us"] for label, e in m["groups"].items()}
        rows.append({"drafter": "h4096", "window": w, "mode": "graph", "us_per_step": m["step_us"]})
        rows.append({"drafter": "h4096", "window": w, "mode": "kernels", "accept": 6, "n_nodes": m["n_nodes"],
                     "kernels_us": kernels, "sum_us": sum(kernels.values()), "graph_us": m["step_us"]})
    return {"bench": "step", "meta": {"device": {"backend": backend}}, "rows": rows}


def test_fit_recovers_the_parameters_the_run_was_timed_with():
    f = cal.fit([_run()], H200)
    assert set(f.overrides) == set(cal.FITTED)
    for k, v in TRUTH.items():
        assert f.overrides[k] == pytest.approx(v, rel=0.02), (k, f.overrides[k], f.evidence[k])
    assert "gemm_stream[gate_up]" in f.evidence["hbm_Bps"] and "qkv" not in f.evidence["hbm_Bps"]
    text = cal.report(f, H200)
    assert "hbm_Bps" in text and "graph step measured" in text
    assert text.count("groups within +-25%") == 2
    # before the fit the node gaps were mispriced: the step prediction moves to the measurement
    first = next(line for line in text.splitlines() if "window 2048" in line)
    meas, before, after = (float(x) for x in
                           (first.split("measured ")[1].split(" us")[0], first.split("predicted ")[1].split(" ->")[0],
                            first.split("-> ")[1]))
    assert abs(after - meas) < 0.01 * meas < abs(before - meas)


def test_hidden_epilogue_and_gapless_graphs_keep_their_estimates():
    doc = _run(windows=(2048,), truth={"rope_round_clocks": 1.0, "node_gap_s": 1e-9})
    f = cal.fit([doc], H200)
    assert "rope_round_clocks" not in f.overrides and "hidden" in f.evidence["rope_round_clocks"]
    assert f.overrides["node_gap_s"] == pytest.approx(1e-9, rel=0.05)
    r = doc["rows"][1]
    r["graph_us"] = r["sum_us"] - 1.0     # nodes add up to more than the graph step
    f = cal.fit([doc], H200)
    assert "node_gap_s" not in f.overrides and "not fitted" in f.evidence["node_gap_s"]


def test_emulated_runs_are_refused():
    with pytest.raises(ValueError, match="not GPU times"):
        cal.fit([_run(windows=(2048,), backend="emulated")], H200)
    with pytest.raises(ValueError, match="no kernel-time rows"):
        cal.fit([{"bench": "gemm", "rows": []}], H200)


def test_cli_writes_a_calibration_file_the_model_reads(tmp_path, capsys):
    run = tmp_path / "step_quick.json"
    run.write_text(json.dumps(_run(windows=(2048,))))
    out = tmp_path / "calibration.json"
    out.write_text(json.dumps({"H100": {"hbm_Bps": 3.0e12}, "H200": {"l2_Bps": 9e12}}))
    assert cal.main([str(run), "--write", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["H100"] == {"hbm_Bps": 3.0e12} and data["H200"]["l2_Bps"] == 9e12   # others kept
    g = get_gpu("H200", out)
    assert g.hbm_Bps == pytest.approx(TRUTH["hbm_Bps"], rel=0.02) and g.sources["node_gap_s"] == "calibration file"
    emu = tmp_path / "emu.json"
    emu.write_text(json.dumps(_run(windows=(2048,), backend="emulated")))
    assert cal.main([str(emu)]) == 2
