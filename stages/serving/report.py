"""The `serving` pipeline's README tables, from its DVC metrics (`paperline report serving`)."""

from __future__ import annotations

from typing import Any

STATS = (("ttft_mean", "mean TTFT"), ("ttft_p90", "P90 TTFT"), ("e2e_mean", "mean E2E"),
         ("e2e_p90", "P90 E2E"))
QUEUES = (("mm1", "M/M/1 mean wait"), ("md1", "M/D/1 mean wait"),
          ("mg1", "M/G/1 mean wait (Pollaczek-Khinchine)"),
          ("mg1_ps", "M/G/1-PS mean sojourn E[S]/(1-rho)"),
          ("kleinrock_fcfs", "Kleinrock sum rho_p W_p, FCFS"),
          ("kleinrock_sjf", "Kleinrock sum rho_p W_p, SJF"))


def _profile(m: dict[str, Any]) -> list[str]:
    if "prefill_s0" not in m:
        return []
    return [
        "**Latency profile** (`data/profile.json`, MLflow model `serving-profile`): "
        f"prefill T = {m['prefill_s0'] * 1e3:.3f} ms + {m['prefill_s_per_token'] * 1e6:.2f} us "
        f"x sum(l) + {m['prefill_s_per_token2'] * 1e9:.3f} ns x sum(l^2); decode step T = "
        f"{m['decode_s0'] * 1e3:.3f} ms + {m['decode_s_per_seq'] * 1e6:.2f} us x B + "
        f"{m['decode_s_per_ctx_token'] * 1e9:.2f} ns x C.", "",
        "| form | points | MAPE | R^2 |", "|---|---|---|---|",
        *(f"| {form} | {m.get(f'fit/{form}_points', float('nan')):.0f} | "
          f"{m[f'fit/{form}_mape']:.1%} | {m[f'fit/{form}_r2']:.3f} |"
          for form in ("prefill", "decode") if f"fit/{form}_mape" in m),
        ""]


def _queueing(m: dict[str, Any]) -> list[str]:
    if "checks" not in m:
        return []
    lines = [f"**Check 1, queueing theory** ({m['passed']:.0f} of {m['checks']:.0f} pass: the "
             "theory inside the simulated value's 95% batch-means interval; routing and "
             "batching off, E[S] = 1 s):", "",
             "| check | theory (s) | simulated (s), 95% CI | pass |", "|---|---|---|---|"]
    for key, label in QUEUES:
        if f"{key}/theory" in m:
            lines.append(f"| {label} | {m[f'{key}/theory']:.4f} | {m[f'{key}/simulated']:.4f} "
                         f"± {m[f'{key}/half_width']:.4f} | "
                         f"{'yes' if m[f'{key}/pass'] else '**no**'} |")
    lines += ["", f"Little's law L = λW: largest relative gap over the runs "
              f"{m['little/max_rel_gap']:.1e}; Kleinrock on the sample path (SJF vs FCFS, same "
              f"arrivals): relative gap {m['kleinrock/sample_path_rel_gap']:.1e}.", ""]
    return lines


def _validate(m: dict[str, Any]) -> list[str]:
    rates = sorted({float(k.split("/")[0][4:]) for k in m if k.startswith("rate")})
    if not rates:
        return []
    target = m.get("target_rel_err", 0.2)
    lines = [f"**Check 2, against the real server** (relative error (simulated - measured) / "
             f"measured; target within ±{target:.0%}; `profile`: the measured profile, "
             "`server log`: the same forms refitted on the server's own iterations). "
             f"Load average (1 min) {m['load_avg_1m_before']:.2f} before, "
             f"{m['load_avg_1m_after']:.2f} after; the server's iterations took "
             f"{m['iteration_slowdown']:.2f}x the profile's prediction (median).", "",
             "| rate (req/s) | requests | utilisation (sim) | latency model | "
             + " | ".join(f"{label}: measured → error" for _, label in STATS) + " |",
             "|---|---|---|---|" + "---|" * len(STATS)]
    for rate in rates:
        key = f"rate{rate:g}"
        for name, label in (("profile", "profile"), ("server_log", "server log")):
            cells = []
            for s, _ in STATS:
                err = m[f"{key}/{name}/{s}_rel_err"]
                mark = "" if abs(err) <= target else " ✗"
                cells.append(f"{m[f'{key}/measured/{s}'] * 1e3:.1f} ms → {err:+.1%}{mark}")
            lines.append(f"| {rate:g} | {m[f'{key}/requests']:.0f} | "
                         f"{m[f'{key}/{name}/utilisation']:.2f} | {label} | "
                         + " | ".join(cells) + " |")
    lines += ["", f"Within ±{target:.0%}: profile {m['profile/within_target']:.0f}, server log "
              f"{m['server_log/within_target']:.0f} of {m['comparisons']:.0f} comparisons. "
              "Plot: `dvc plots show pipelines/serving/dvc.yaml` (simulated against measured).",
              ""]
    return lines


def results_table(metrics: dict[str, dict[str, Any]]) -> str:
    lines = (_profile(metrics.get("profile_engine", {}))
             + _queueing(metrics.get("queueing_check", {}))
             + _validate(metrics.get("validate_sim", {})))
    return "\n".join(lines) if lines else "_No results yet: run the pipeline._\n"
