"""The `plugmem` pipeline end to end at `smoke` through real `dvc repro` (after the shared stages)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from stages.core import io
from tests.conftest import assert_bad_param_rejected, dvc, paperline
from tests.pipelines.test_base_pipeline import mlflow_client

pytestmark = pytest.mark.slow

P = Path("pipelines/plugmem")
ARMS = ("none", "raw", "bm25", "plugmem", "plugmem_no_reasoning", "plugmem_no_tags", "oracle")


@pytest.fixture(scope="module")
def plugmem_repo(smoke_repo: Path) -> Path:
    proc = paperline(smoke_repo, "repro", "plugmem", timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return smoke_repo


def test_memories_answers_and_structurer_well_formed(plugmem_repo: Path):
    from stages.core.checks import read_parquet_checked
    from stages.plugmem.memory import context_spec

    ctxs = read_parquet_checked(plugmem_repo / P / "data/contexts.parquet", context_spec())
    ev = ctxs.filter(pl.col("split") == "eval")
    # every arm answers every eval question at both noise levels, paired
    per = ev.group_by("arm").agg(pl.col("qid").n_unique().alias("q"), pl.len())
    assert set(per["arm"]) == set(ARMS) and per["len"].n_unique() == 1
    assert set(ev["noise"]) == {1, 2}
    assert all(json.loads(m) == [] for m in ev.filter(pl.col("arm") == "none")["memory"])
    # the oracle parser's memory holds facts in the paper's entity-resolved form
    oracle = [x for m in ev.filter(pl.col("arm") == "oracle")["memory"] for x in json.loads(m)]
    assert oracle and all(x.endswith(".") and "**" not in x for x in oracle)
    answers = pl.read_parquet(plugmem_repo / P / "data/answers.parquet")
    assert answers.height == ev.height
    a = io.read_metrics(plugmem_repo / P / "details/answer.json")
    for arm in ARMS:
        assert 0 <= a[f"{arm}/acc"] <= 1 and 0 <= a[f"{arm}/perfect"] <= 1
    assert a["none/tokens"] == 0 and a["raw/tokens"] > a["oracle/tokens"] > 0
    s = io.read_metrics(plugmem_repo / P / "details/structure.json")
    assert 0 <= s["eval/parse_rate"] <= 1 and s["eval/observations"] > 0
    m = io.read_metrics(plugmem_repo / P / "details/memory.json")
    assert m["tau_tag"] in (0.5, 0.8) and m["tau_seg"] in (0.3, 0.75)   # the smoke grid


def test_compare_verdicts_readme_and_registered_models(plugmem_repo: Path):
    c = io.read_metrics(plugmem_repo / P / "details/compare.json")
    for name in ("acc_vs_raw", "acc_vs_bm25", "tokens_vs_raw", "updates_vs_raw", "reasoning",
                 "tags"):
        assert c[f"claim/{name}/verdict"] in (-1.0, 0.0, 1.0)
        assert c[f"claim/{name}/pairs"] == 4                      # 2 seeds x 2 noise levels
    assert c["claim/acc_vs_raw/paper_effect"] == 0.039
    m = json.loads((plugmem_repo / P / "metrics/compare.json").read_text())
    assert set(m) == {"reproduced", "inconclusive", "contradicted"}
    readme = (plugmem_repo / P / "README.md").read_text()
    block = readme.split("<!-- results:start")[1].split("<!-- results:end")[0]
    assert "| plugmem |" in block and "oracle parser [upper bound]" in block
    client = mlflow_client(plugmem_repo)
    from stages.models.backend import LocalHFBackend

    for name in ("plugmem-structurer", "plugmem-reader"):
        v = client.get_model_version_by_alias(name, "learned")
        local = client.download_artifacts(v.run_id, "model", str(plugmem_repo / "dl" / name))
        backend = LocalHFBackend(local)                     # the real HF loading code
        assert backend.complete(["Memory:\n(none)\nQuestion: Where"],
                                max_new_tokens=2)[0][0].n_tokens >= 1


def test_arms_side_by_side_in_mlflow(plugmem_repo: Path):
    client = mlflow_client(plugmem_repo)
    exp = client.get_experiment_by_name("plugmem")
    runs = [r for r in client.search_runs([exp.experiment_id], max_results=5000)
            if r.data.tags.get("paperline.source_stage") == "answer"
            and r.data.tags.get("paperline.method")]
    assert {(r.data.params["arm"], r.data.params["seed"]) for r in runs} == \
        {(a, s) for a in ARMS for s in ("0", "1")}
    assert all("acc" in r.data.metrics and "tokens" in r.data.metrics for r in runs)


def test_bad_params_rejected_by_name_before_compute(plugmem_repo: Path):
    assert_bad_param_rejected(plugmem_repo / P, "plugmem", "memory", "memory.arms",
                              ["none", "graphrag"], "graphrag", untouched=plugmem_repo / P / "data/contexts.parquet")


def test_second_repro_of_the_pipeline_does_nothing(plugmem_repo: Path):
    out = dvc(plugmem_repo, "repro", str(P / "dvc.yaml")).stdout
    assert "Running stage" not in out, out[-2000:]


def test_served_structurer_writes_the_same_facts_as_the_local_one(plugmem_repo: Path):
    """The gpu profile's path: the structurer behind the OpenAI-compatible server (the local
    one here) through the backend gives the `structure` stage's very rows."""
    import os

    from stages.models.backend import BackendConfig, LocalHFBackend, make_backend
    from stages.plugmem.structure import structure

    folder = plugmem_repo / P / "models/structurer"
    texts = ["I just moved to Oslo.", "Thanks, that was helpful.", "My pet is a cat."]
    proc = subprocess.Popen([sys.executable, "-m", "stages.models.serve", "--model", str(folder),
                             "--name", "plugmem-structurer", "--port", "0"],
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving plugmem-structurer on http://127.0.0.1:"), \
            line + (proc.stderr.read()[-2000:] if proc.poll() is not None else "")
        url = line.split(" on ")[1].strip()
        served = structure(make_backend(BackendConfig(kind="openai", model="plugmem-structurer",
                                                      base_url=url)), texts, 12)
    finally:
        os.kill(proc.pid, 15)
        proc.wait(timeout=30)
    assert served.equals(structure(LocalHFBackend(folder), texts, 12))
