"""The `ampd` pipeline end to end at `smoke` through real `dvc repro`, and its input checks."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
import yaml

from stages.core import io
from tests.conftest import dvc, paperline

pytestmark = pytest.mark.slow

P = Path("pipelines/ampd")
PROFILE = Path("pipelines/serving/data/profile.json")
ARMS = ["dynamo", "local", "colocated", "routing", "reorder", "planned"]


def fake_measured_profile(repo: Path, force: bool = False, like: str | None = None) -> None:
    """A stand-in for the measured tiny-model profile (millisecond-scale constants in the
    measured file's format, or the shipped profile `like` renamed), for stages run directly,
    without dvc running `serving` first."""
    if (repo / "pipelines/serving/dvc.yaml").is_file() and not force:
        return  # the real stage produces it (dvc repro runs it first)
    from stages.serving.latency import LatencyProfile, load_profile, save_profile

    if like is not None:
        save_profile(load_profile(like).model_copy(update={"name": "measured",
                                                           "source": "test stand-in"}),
                     repo / PROFILE)
        return
    save_profile(LatencyProfile(
        name="measured", source="test stand-in", prefill_s0=0.004, prefill_s_per_token=2.0e-5,
        prefill_s_per_token2=1.0e-9, decode_s0=0.006, decode_s_per_seq=1.5e-4,
        decode_s_per_ctx_token=2.0e-7, kv_bytes_per_token=4096, transfer_s0=2e-4,
        link_bytes_per_s=2.0e9), repo / PROFILE)


@pytest.fixture(scope="module")
def ampd_repo(smoke_repo: Path) -> Path:
    fake_measured_profile(smoke_repo)
    started = time.time()
    proc = paperline(smoke_repo, "repro", "ampd", timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    print(f"paperline repro ampd: {time.time() - started:.1f} s")
    return smoke_repo


def test_every_arm_has_a_result_per_seed_and_rate(ampd_repo: Path):
    runs = pl.read_parquet(ampd_repo / P / "data/sim/runs.parquet")
    grid = json.loads((ampd_repo / P / "data/workload/grid.json").read_text())
    assert grid["seeds"] == [0, 1] and len(grid["loads"]) == 2
    got = sorted(runs.select("arm", "seed", "load_index").iter_rows())
    assert got == sorted((a, s, i) for a in ARMS for s in (0, 1) for i in (0, 1))
    assert runs["attainment"].is_between(0, 1).all()
    # the rate grid is the profile's capacity times the loads, not hand-set sessions/s
    assert grid["rates"] == pytest.approx([x * grid["capacity"]["cluster"] for x in grid["loads"]])
    m = io.read_metrics(ampd_repo / P / "details/compare.json")
    for arm in ARMS:
        for i in (0, 1):
            assert 0 <= m[f"{arm}/attainment/{i}/mean"] <= 1
    for name in ("reorder_ge_dynamo", "planned_ge_colocated", "gain_vs_dynamo", "reorder_gain",
                 "local_fraction_low", "crossover_low", "crossover_high"):
        assert m[f"claim/{name}/verdict"] in (-1.0, 0.0, 1.0)
        assert m[f"claim/{name}/pairs"] == 2
    assert m["claim/gain_vs_dynamo/paper_effect"] == pytest.approx(0.6729)
    assert m["crossover_appears"] in (0.0, 1.0)
    plot = pl.read_csv(ampd_repo / P / "plots/attainment.csv")
    assert plot.columns == ["load", "rate", *ARMS] and plot.height == 2


def test_common_random_numbers_one_trace_for_every_arm(ampd_repo: Path):
    """Every arm ran the same rounds (session, round, lengths) on each (seed, rate); the two
    rates of a seed hold the same sessions (time compressed), two seeds different ones."""
    rounds = pl.read_parquet(ampd_repo / P / "data/sim/rounds.parquet")
    key = ["session", "round", "input_tokens", "output_tokens"]
    for (seed, load), g in rounds.group_by(["seed", "load_index"]):
        ref = g.filter(pl.col("arm") == "dynamo").sort(["session", "round"]).select(key)
        for arm in ARMS[1:]:
            assert g.filter(pl.col("arm") == arm).sort(["session", "round"]).select(key).equals(ref)
    one = rounds.filter(pl.col("arm") == "dynamo")
    lengths = {k: one.filter((pl.col("seed") == k[0]) & (pl.col("load_index") == k[1]))
               .sort(["session", "round"])["input_tokens"].to_list()
               for k in [(0, 0), (0, 1), (1, 0)]}
    assert lengths[(0, 0)] == lengths[(0, 1)] and lengths[(0, 0)] != lengths[(1, 0)]


def test_where_prefills_ran_and_the_stall_accounting(ampd_repo: Path):
    """Arm a never prefills locally; arm b prefills every round with history locally and no
    first round; only arm b stalls a decode worker (its ITL cost: the test below)."""
    rounds = pl.read_parquet(ampd_repo / P / "data/sim/rounds.parquet")
    a = rounds.filter(pl.col("arm") == "dynamo")
    b = rounds.filter(pl.col("arm") == "local")
    assert not a["local"].any()
    assert b.filter(pl.col("round") > 0)["local"].all()
    assert not b.filter(pl.col("round") == 0)["local"].any()
    runs = pl.read_parquet(ampd_repo / P / "data/sim/runs.parquet")
    stall = dict(runs.group_by("arm").agg(pl.col("stall_s").sum()).iter_rows())
    assert stall["dynamo"] == 0 and stall["local"] > 0
    m = io.read_metrics(ampd_repo / P / "details/compare.json")
    assert m["dynamo/local_fraction/mean"] == 0.0
    assert m["local/local_fraction_history/mean"] == 1.0


def test_local_prefill_stalls_lengthen_the_worst_gap(repo_copy: Path):
    """The worst gap a request sees: a whole local prefill under arm b, a decode step (or a KV
    transfer) under arm a, on the same rounds. Run on fixed constants (DistServe's A100 profile
    as the `measured` one, stages run directly) so that the outcome is the same on every
    machine: on the tiny model's measured timings, which differ run to run, a loaded decode
    step can outlast a 400-token prefill and the comparison would test the measurement."""
    fake_measured_profile(repo_copy, force=True, like="a100")
    _set(repo_copy, "simulate.arms", ["dynamo", "local"])
    for stage in ("workload", "simulate"):
        proc = _stage(repo_copy, stage)
        assert proc.returncode == 0, proc.stderr[-2000:]
    rounds = pl.read_parquet(repo_copy / P / "data/sim/rounds.parquet")
    a = rounds.filter(pl.col("arm") == "dynamo")
    b = rounds.filter(pl.col("arm") == "local")
    assert a.height == b.height > 0
    runs = pl.read_parquet(repo_copy / P / "data/sim/runs.parquet")
    stall = dict(runs.group_by("arm").agg(pl.col("stall_s").sum()).iter_rows())
    assert stall["dynamo"] == 0 and stall["local"] > 0
    assert b["itl_max_s"].mean() > a["itl_max_s"].mean()


def test_plan_reorder_bound_readme_and_no_op_repro(ampd_repo: Path):
    plan = json.loads((ampd_repo / P / "data/plan/plan.json").read_text())
    assert plan["brute_force_match"] is True            # the ILP against enumeration
    assert plan["gpus"] <= 8 and plan["prefill"] and plan["decode"]
    s = io.read_metrics(ampd_repo / P / "details/simulate.json")
    assert s["runs"] == 24 and s["max_overtaken"] <= 2  # lookahead 3: at most 2 overtakes
    readme = (ampd_repo / P / "README.md").read_text()
    block = readme.split("<!-- results:start")[1].split("<!-- results:end")[0]
    m = io.read_metrics(ampd_repo / P / "details/compare.json")
    assert "| (f) planned |" in block and f"{m['planned/attainment/0/mean']:.3f}" in block
    assert "the crossover appears" in block
    out = dvc(ampd_repo, "repro", str(P / "dvc.yaml")).stdout
    assert "Running stage" not in out, out[-2000:]


def _stage(repo: Path, stage: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stages", "ampd", stage], cwd=repo,
                          capture_output=True, text=True, timeout=300)


def _set(repo: Path, dotted: str, value: object) -> None:
    path = repo / P / "params.yaml"
    params = yaml.safe_load(path.read_text())
    node = params
    *keys, last = dotted.split(".")
    for k in keys:
        node = node[k]
    node[last] = value
    path.write_text(yaml.safe_dump(params, sort_keys=False))


def test_arms_side_by_side_in_mlflow(ampd_repo: Path):
    """A run per (arm, seed) from `compare` (group `simulate`), each with its params and the
    same metric names stepped by load index: MLflow's Compare view shows arms side by side."""
    from tests.pipelines.test_base_pipeline import mlflow_client

    client = mlflow_client(ampd_repo)
    exp = client.get_experiment_by_name("ampd")
    runs = [r for r in client.search_runs([exp.experiment_id], max_results=2000)
            if r.data.tags.get("paperline.source_stage") == "compare"
            and r.data.tags.get("paperline.method")]
    table = pl.read_parquet(ampd_repo / P / "data/sim/runs.parquet")
    want = {(a, str(int(s))) for a, s in table.select("arm", "seed").unique().iter_rows()}
    assert {(r.data.params["arm"], r.data.params["seed"]) for r in runs} == want
    assert {frozenset(r.data.metrics) for r in runs} == {
        frozenset({"attainment", "round_attainment", "local_fraction", "rate"})}
    assert "wall_s" not in table.columns   # wall times in MLflow, not in the data


@pytest.mark.parametrize("dotted, value, expected", [
    ("simulate.arms", ["dynamo", "vllm"], "unknown arms ['vllm']"),
    ("profiles.smoke.workload.loads", [1.0, 0.5], "strictly increasing"),
    ("workload.latency_profile", "h100", "unknown latency profile 'h100'"),
    ("simulate.lookahead", 0, "simulate.lookahead"),
])
def test_bad_params_rejected_by_name_before_compute(repo_copy: Path, dotted, value, expected):
    _set(repo_copy, dotted, value)
    proc = _stage(repo_copy, "workload")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert expected in proc.stderr and "Traceback" not in proc.stderr
    assert dotted.split(".")[-2] in proc.stderr            # the section is named
    data = repo_copy / P / "data"                          # nothing computed (the committed
    assert not [f for f in data.rglob("*") if f.is_file() and f.name != ".gitignore"]  # ignores)


def test_malformed_trace_and_missing_profile_rejected_before_compute(repo_copy: Path):
    proc = _stage(repo_copy, "workload")                   # no measured profile yet
    assert proc.returncode == 3 and "profile.json" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    fake_measured_profile(repo_copy, force=True)
    assert _stage(repo_copy, "workload").returncode == 0
    trace = repo_copy / P / "data/workload/traces/seed1_load1.parquet"
    df = pl.read_parquet(trace)
    df.with_columns(pl.when(pl.col("round") == 1).then(0).otherwise(pl.col("output_tokens"))
                    .alias("output_tokens")).write_parquet(trace)
    proc = _stage(repo_copy, "simulate")
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "seed1_load1.parquet" in proc.stderr and "output_tokens" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (repo_copy / P / "data/sim").exists()      # no run started
