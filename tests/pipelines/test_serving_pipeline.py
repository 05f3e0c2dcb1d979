"""The `serving` pipeline end to end at `smoke` through real `dvc repro` (after the shared stages):
the measured profile (file + MLflow registry), check 1 (queueing theory) and check 2 (a real
server on 127.0.0.1 against the simulator), and the README block generated from them."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import yaml

from stages.serving.latency import LatencyProfile, ProfileError, load_profile
from stages.core import io
from tests.conftest import dvc, paperline
from tests.pipelines.test_base_pipeline import mlflow_client

pytestmark = pytest.mark.slow

P = Path("pipelines/serving")


@pytest.fixture(scope="module")
def serving_repo(smoke_repo: Path) -> Path:
    proc = paperline(smoke_repo, "repro", "serving", timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return smoke_repo


def test_profile_written_valid_and_registered(serving_repo: Path):
    profile = load_profile(serving_repo / P / "data/profile.json")
    assert profile.name == "tiny-cpu" and "profile_engine" in profile.source
    # a real measurement: positive costs, fit errors recorded
    assert profile.prefill_s_per_token > 0 and profile.decode_step_time(1, 16) > 0
    assert 0 <= profile.fit["prefill_mape"] < 1 and 0 <= profile.fit["decode_mape"] < 1
    m = io.read_metrics(serving_repo / P / "details/profile_engine.json")
    assert m["fit/decode_mape"] == pytest.approx(profile.fit["decode_mape"])
    timings = pl.read_parquet(serving_repo / P / "data/profile_timings.parquet")
    assert set(timings["kind"]) == {"prefill", "decode", "transfer"}

    client = mlflow_client(serving_repo)
    versions = client.search_model_versions("name = 'serving-profile'")
    assert versions, "serving-profile not in the MLflow registry"
    latest = max(versions, key=lambda v: int(v.version))
    assert client.get_registered_model("serving-profile").aliases["champion"] == latest.version
    run = client.get_run(latest.run_id)
    assert run.data.tags["paperline.stage"] == "profile_engine"     # the run that made it
    assert latest.tags["fit.decode_mape"] == f"{profile.fit['decode_mape']:.4g}"
    # the artefact is the profile itself, byte for byte
    files = [f.path for f in client.list_artifacts(latest.run_id, "profile")]
    assert files == ["profile/profile.json"]
    local = client.download_artifacts(latest.run_id, "profile/profile.json",
                                      str(serving_repo / ".paperline" / "dl"))
    assert Path(local).read_bytes() == (serving_repo / P / "data/profile.json").read_bytes()


def test_queueing_check_passes(serving_repo: Path):
    m = io.read_metrics(serving_repo / P / "details/queueing_check.json")
    assert m["checks"] == 6 and m["passed"] == 6, m
    assert m["mm1/theory"] == pytest.approx(1.0)           # rho 0.5, E[S] 1 s
    assert 0 < m["mm1/half_width"] < 0.3
    assert m["little/max_rel_gap"] < 1e-9
    assert m["kleinrock/sample_path_rel_gap"] < 1e-9


def test_validate_sim_errors_finite_and_in_the_readme(serving_repo: Path):
    m = io.read_metrics(serving_repo / P / "details/validate_sim.json")
    for rate in ("rate4", "rate8"):
        assert m[f"{rate}/requests"] == 20
        for model in ("profile", "server_log"):
            for s in ("ttft_mean", "ttft_p90", "e2e_mean", "e2e_p90"):
                assert math.isfinite(m[f"{rate}/{model}/{s}_rel_err"])
            assert 0 < m[f"{rate}/{model}/utilisation"] <= 1.0 + 1e-9
        # a request ends after its first token: E2E >= TTFT, measured and simulated
        assert m[f"{rate}/measured/e2e_mean"] > m[f"{rate}/measured/ttft_mean"] > 0
    assert m["iteration_slowdown"] > 0 and m["load_avg_1m_before"] >= 0
    req = pl.read_parquet(serving_repo / P / "data/validate_requests.parquet")
    assert req.height == 40 and (req["output_len"] >= 8).all()
    assert (req["profile_e2e_s"] >= req["profile_ttft_s"]).all()
    plot = pl.read_csv(serving_repo / P / "plots/validate_sim.csv")
    assert plot.height == 2 * 2 * 4 and (plot["simulated_s"] > 0).all()

    readme = (serving_repo / P / "README.md").read_text()
    block = readme.split("<!-- results:start")[1].split("<!-- results:end")[0]
    assert "Check 1, queueing theory** (6 of 6 pass" in block
    assert "Check 2, against the real server" in block
    err = m["rate8/server_log/e2e_mean_rel_err"]
    assert f"{m['rate8/measured/e2e_mean'] * 1e3:.1f} ms → {err:+.1%}" in block
    assert "MLflow model `serving-profile`" in block


def test_second_repro_does_nothing(serving_repo: Path):
    out = dvc(serving_repo, "repro", str(P / "dvc.yaml")).stdout
    assert "Running stage" not in out, out[-2000:]


def test_corrupted_profile_rejected_by_name_before_serving(serving_repo: Path):
    """A downstream read of a broken profile.json fails with ProfileError naming the field, and
    validate_sim stops on it before it starts a server."""
    path = serving_repo / P / "data/profile.json"
    good = path.read_bytes()
    data = json.loads(good)
    try:
        data["decode_s_per_seq"] = -1.0
        path.write_text(json.dumps(data))
        with pytest.raises(ProfileError, match=r"decode_s_per_seq: .*greater than or equal to 0"):
            load_profile(path)
        proc = subprocess.run([sys.executable, "-m", "stages", "serving", "validate_sim"],
                              cwd=serving_repo / P, capture_output=True, text=True, timeout=120,
                              env={**__import__("os").environ, "PAPERLINE_TRACKING": "off"})
        assert proc.returncode != 0
        assert "invalid latency profile" in proc.stderr and "decode_s_per_seq" in proc.stderr
        assert "serving on http://" not in proc.stdout + proc.stderr   # no server was started
        path.write_text("{not json")
        with pytest.raises(ProfileError, match="not valid JSON"):
            load_profile(path)
    finally:
        path.write_bytes(good)
    assert LatencyProfile.model_validate(json.loads(path.read_text()))
    # the profile is back: DVC sees nothing to do
    status = yaml.safe_load(dvc(serving_repo, "status", str(P / "dvc.yaml"), "--json").stdout
                            or "{}")
    assert not status, status
