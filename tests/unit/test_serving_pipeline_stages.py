"""The serving pipeline's own stage code, cheaply: validate_sim's params, the server-log refit,
and the README tables (the end-to-end run is tests/pipelines/test_serving_pipeline.py)."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from stages.serving import profile as P
from stages.serving import report
from stages.serving.validate import Config


@pytest.mark.parametrize("rates, match", [([], "rates = \\[\\]"), ([2.0, -1.0], "rates > 0"),
                                          ([3.0, 3.0], "distinct")])
def test_validate_sim_rejects_bad_rates_by_name(rates, match):
    with pytest.raises(ValidationError, match=match):
        Config(rates=rates, requests=20)


def test_validate_sim_rejects_a_bad_load_and_too_few_requests():
    with pytest.raises(ValidationError, match="prompt_len_min = 64 > prompt_len_max = 8"):
        Config(rates=[1.0], requests=20, load={"prompt_len_min": 64, "prompt_len_max": 8})
    with pytest.raises(ValidationError, match="requests"):
        Config(rates=[1.0], requests=2)
    with pytest.raises(ValidationError, match="Extra inputs"):
        Config(rates=[1.0], requests=20, rate=[1.0])
    assert Config(rates=[8.0, 2.0], requests=20).rates == [2.0, 8.0]


def test_server_log_refit_keeps_the_total_time_of_noisy_iterations():
    """One noisy sample per iteration, right-skewed (a loaded machine): the refit must keep the
    sum of iteration times (what queueing sees); a relative-error fit lands well below it."""
    rng = np.random.default_rng(0)
    log = []
    for _ in range(600):
        b = int(rng.integers(1, 9))
        ctx = b * int(rng.integers(16, 96))
        t = (0.004 + 0.001 * b + 1e-6 * ctx) * rng.lognormal(0.0, 0.5)
        log.append({"kind": "decode", "batch": b, "sum_l": 0, "sum_l2": 0, "ctx_tokens": ctx,
                    "seconds": t})
    for n in (8, 16, 32, 48, 64):
        log.append({"kind": "prefill", "batch": 1, "sum_l": n, "sum_l2": n * n,
                    "ctx_tokens": 0, "seconds": 0.005 + 1e-4 * n})
    like = {"name": "m", "source": "s", "prefill_s0": 0.0, "prefill_s_per_token": 0.0,
            "decode_s0": 0.0, "decode_s_per_seq": 0.0, "decode_s_per_ctx_token": 0.0,
            "kv_bytes_per_token": 8, "link_bytes_per_s": 1e9}
    fit = P.fit_iterations(log, like)
    dec = [r for r in log if r["kind"] == "decode"]
    total = sum(r["seconds"] for r in dec)
    pred = sum(fit["decode_s0"] + fit["decode_s_per_seq"] * r["batch"]
               + fit["decode_s_per_ctx_token"] * r["ctx_tokens"] for r in dec)
    assert pred == pytest.approx(total, rel=0.01)
    rel, _ = P.fit_decode([r["batch"] for r in dec], [r["ctx_tokens"] for r in dec],
                          [r["seconds"] for r in dec], relative=True)
    rel_pred = sum(rel[0] + rel[1] * r["batch"] + rel[2] * r["ctx_tokens"] for r in dec)
    assert rel_pred < 0.9 * total       # the bias the unweighted refit avoids


def _validate_metrics(err: float) -> dict[str, float]:
    m = {"load_avg_1m_before": 1.5, "load_avg_1m_after": 1.7, "iteration_slowdown": 1.3,
         "target_rel_err": 0.2, "profile/within_target": 3.0, "server_log/within_target": 4.0,
         "comparisons": 4.0, "rate4/requests": 20.0}
    for s in ("ttft_mean", "ttft_p90", "e2e_mean", "e2e_p90"):
        m[f"rate4/measured/{s}"] = 0.1
        for model in ("profile", "server_log"):
            m[f"rate4/{model}/{s}_rel_err"] = err if model == "profile" else 0.05
            m[f"rate4/{model}/utilisation"] = 0.4
    return m


def test_readme_tables_mark_errors_beyond_the_target():
    text = report.results_table({"validate_sim": _validate_metrics(-0.35)})
    row = next(line for line in text.splitlines() if "| profile |" in line)
    assert row.count("100.0 ms → -35.0% ✗") == 4
    row = next(line for line in text.splitlines() if "| server log |" in line)
    assert "✗" not in row and "+5.0%" in row
    assert "Load average (1 min) 1.50 before" in text
    assert report.results_table({}).startswith("_No results yet")
