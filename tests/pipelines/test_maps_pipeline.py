"""The `maps` pipeline end to end at `smoke` through real `dvc repro` (after the shared stages)."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import polars as pl
import pytest
import yaml

from stages.core import io
from tests.conftest import assert_bad_param_rejected, dvc, paperline
from tests.pipelines.test_base_pipeline import mlflow_client

pytestmark = pytest.mark.slow

P = Path("pipelines/maps")
PROFILE = Path("pipelines/serving/data/profile.json")


@pytest.fixture(scope="module")
def maps_repo(smoke_repo: Path) -> Path:
    # The measured latency profile is pipeline `serving`'s output; where that pipeline is not in
    # this checkout, a stand-in file (the A100 constants renamed) plays its part.
    if not (smoke_repo / "pipelines/serving/dvc.yaml").is_file():
        from stages.serving.latency import load_profile, save_profile

        fake = load_profile("a100").model_copy(update={"name": "measured",
                                                      "source": "test stand-in"})
        save_profile(fake, smoke_repo / PROFILE)
    proc = paperline(smoke_repo, "repro", "maps", timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return smoke_repo


def _params(repo: Path) -> dict:
    return yaml.safe_load((repo / P / "params.yaml").read_text())


def test_every_arm_seed_rate_present_on_identical_traces(maps_repo: Path):
    runs = pl.read_parquet(maps_repo / P / "data/runs.parquet")
    params = _params(maps_repo)
    smoke = params["profiles"]["smoke"]["workload"]
    arms = params["simulate"]["arms"]
    seeds, n_rates = smoke["seeds"], len(smoke["load_factors"])
    for wl in ("sharegpt", "bursty", "own"):
        want = {(a, s, r) for a in arms for s in seeds for r in range(n_rates)
                if not (wl == "own" and a == "maps_sp160m")}   # no weak predictor on `own`
        got = {(a, s, r) for a, s, r in runs.filter(pl.col("workload") == wl)
               .select("arm", "seed", "rate_index").iter_rows()}
        assert got == want, (wl, want ^ got)
    # common random numbers: every arm of a (workload, seed, rate) saw the same trace, and every
    # rate of a seed the same requests (only the arrival times are compressed)
    per_trace = runs.group_by("workload", "seed", "rate_index").agg(pl.col("trace_sha").n_unique())
    assert (per_trace["trace_sha"] == 1).all()
    per_seed = runs.group_by("workload", "seed").agg(pl.col("lengths_sha").n_unique(),
                                                     pl.col("trace_sha").n_unique().alias("t"))
    assert (per_seed["lengths_sha"] == 1).all() and (per_seed["t"] == n_rates).all()
    assert runs["requests"].min() == smoke["n_requests"]
    # seeds differ (else the CIs are over copies)
    assert runs.filter(pl.col("workload") == "sharegpt")["lengths_sha"].n_unique() == len(seeds)


def test_no_decoder_over_capacity_and_policies_differ(maps_repo: Path):
    runs = pl.read_parquet(maps_repo / P / "data/runs.parquet")
    for c in ("kv_peak_decoder0", "kv_peak_decoder1"):
        # never over capacity; used by some run (a dispatcher may leave one idle at low load)
        assert 0.0 < runs[c].max() <= 1.0 and runs[c].min() >= 0.0
    sim = io.read_metrics(maps_repo / P / "details/simulate.json")
    assert sim["kv_peak_max"] <= 1.0
    # the arms really route differently: round-robin splits requests evenly, MAPS does not
    rr = runs.filter(pl.col("arm") == "round_robin")["share_decoder0"]
    assert ((rr - 0.5).abs() <= 0.01).all()
    mp = runs.filter(pl.col("arm") == "maps")["share_decoder0"]
    assert ((mp - 0.5).abs() > 0.01).any()
    # Llumnix-like is the only arm that migrates
    assert runs.filter(pl.col("arm") != "llumnix")["migrations"].sum() == 0


def test_predictor_registered_and_coverage_with_bounds(maps_repo: Path):
    p = io.read_metrics(maps_repo / P / "details/predictor.json")
    assert 0 <= p["test_coverage"] <= 1
    assert p["coverage_lower_bound"] == pytest.approx(0.9)
    assert p["coverage_lower_bound"] < p["coverage_upper_bound"] < 1
    assert p["test_coverage_ci_low"] <= p["test_coverage"] <= p["test_coverage_ci_high"]
    for k in ("test_mae", "test_acc_100", "q_alpha"):
        assert k in p
    client = mlflow_client(maps_repo)
    v = client.get_model_version_by_alias("maps-predictor", "champion")
    run = client.get_run(v.run_id)                   # the run that made it
    assert run.data.tags.get("paperline.stage") == "predictor"
    c = io.read_metrics(maps_repo / P / "details/compare.json")
    assert c["target_coverage"] == pytest.approx(0.9)
    assert 0.5 < c["sharegpt/maps/coverage"] <= 1.0
    for name in ("maps_vs_rr_mean", "maps_vs_rr_p99", "coverage", "mq_vs_mc", "queue_vs_rr"):
        assert c[f"claim/{name}/verdict"] in (-1.0, 0.0, 1.0)
        assert f"claim/{name}/pairs" in c
    assert c["claim/maps_vs_rr_mean/pairs"] == 8      # 2 workloads x 2 seeds x 2 rates
    assert c["claim/maps_vs_rr_mean/paper_effect"] == -0.426
    m = io.read_metrics(maps_repo / P / "details/motivation.json")
    assert 0 <= m["hp_f_hp"] <= 1 and m["hp_C_hp"] <= m["hp_T_hp"] + 1e-9
    readme = (maps_repo / P / "README.md").read_text()
    block = readme.split("<!-- results:start")[1].split("<!-- results:end")[0]
    assert "| maps |" in block and "MAPS < round-robin, mean E2E" in block
    header = (maps_repo / P / "plots/maps_e2e_sharegpt_mean.csv").read_text().splitlines()[0]
    assert header.startswith("load,rate,") and "maps" in header and "round_robin" in header


def test_bad_params_rejected_by_name_before_compute(maps_repo: Path):
    assert_bad_param_rejected(maps_repo / P, "maps", "simulate", "simulate.arms",
                              ["maps", "mapz"], "mapz", untouched=maps_repo / P / "data/runs.parquet")


def test_malformed_trace_rejected_by_name_before_compute(maps_repo: Path, tmp_path: Path):
    from stages.core.checks import DataValidationError
    from stages.maps import simulate

    folder = tmp_path / "workload"
    shutil.copytree(maps_repo / P / "data/workload", folder)
    victim = folder / "own" / "seed1_rate1.parquet"
    df = pl.read_parquet(victim)
    df.with_columns(pl.when(pl.col("session") == 3).then(0).otherwise(pl.col("output_tokens"))
                    .alias("output_tokens")).write_parquet(victim)
    out = tmp_path / "runs.parquet"
    paths = {"maps_workload": folder, "maps_runs": out}
    ctx = SimpleNamespace(path=lambda k: paths[k])
    with pytest.raises(DataValidationError) as err:
        simulate.run(simulate.Config(cluster={"latency_profile": "a100"}, workers=1), ctx)
    assert "seed1_rate1.parquet" in str(err.value) and "output_tokens" in str(err.value)
    assert not out.exists()


def test_second_repro_of_the_pipeline_does_nothing(maps_repo: Path):
    out = dvc(maps_repo, "repro", str(P / "dvc.yaml")).stdout
    assert "Running stage" not in out, out[-2000:]


def test_arms_side_by_side_in_mlflow(maps_repo: Path):
    """A run per (workload, arm, seed) under `compare`, each with its params and the same metric
    names stepped by rate index, so MLflow's Compare view shows arms side by side."""
    client = mlflow_client(maps_repo)
    exp = client.get_experiment_by_name("maps")
    runs = [r for r in client.search_runs([exp.experiment_id], max_results=5000)
            if r.data.tags.get("paperline.source_stage") == "compare"
            and r.data.tags.get("paperline.method")]
    table = pl.read_parquet(maps_repo / P / "data/runs.parquet")
    want = {(w, a, str(s)) for w, a, s in
            table.select("workload", "arm", "seed").unique().iter_rows()}
    assert {(r.data.params["workload"], r.data.params["arm"], r.data.params["seed"])
            for r in runs} == want
    assert all(r.data.tags["paperline.stage"] == r.data.params["workload"] for r in runs)
    names = {frozenset(k for k in r.data.metrics if k != "coverage") for r in runs}
    assert names == {frozenset({"e2e_mean_s", "e2e_p99_s", "ttft_mean_s", "tpot_mean_s",
                                "queue_len", "preemptions", "rate"})}
    maps_run = next(r for r in runs if r.data.params["arm"] == "maps")
    assert "coverage" in maps_run.data.metrics
    steps = client.get_metric_history(maps_run.info.run_id, "e2e_mean_s")
    assert sorted(m.step for m in steps) == sorted(table["rate_index"].unique().to_list())
