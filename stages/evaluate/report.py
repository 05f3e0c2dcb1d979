"""README results table of the `base` pipeline, rendered from its DVC metrics (never typed)."""

from __future__ import annotations

import re
from typing import Any

_BY_DIFFICULTY = re.compile(r"^(?P<metric>.+)_d(?P<difficulty>\d+)$")


def base_results_table(metrics: dict[str, dict[str, Any]]) -> str:
    ev = metrics.get("evaluate", {})
    base = metrics.get("base", {})
    per: dict[int, dict[str, float]] = {}
    overall: dict[str, float] = {}
    for key, value in ev.items():
        m = _BY_DIFFICULTY.match(key)
        if m:
            per.setdefault(int(m["difficulty"]), {})[m["metric"]] = value
        elif isinstance(value, (int, float)):
            overall[key] = value
    cols = sorted({k for d in per.values() for k in d})
    lines = []
    if per:
        lines += ["| operands | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
        for d in sorted(per):
            lines.append(f"| {d} | " + " | ".join(_pct(per[d].get(c)) for c in cols) + " |")
        lines.append("| all | " + " | ".join(_pct(overall.get(c)) for c in cols) + " |")
    extra = {k: v for k, v in {**{f"train/{k}": v for k, v in base.items()},
                                **{k: v for k, v in overall.items() if k not in cols}}.items()}
    if extra:
        lines += ["", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v:.4g} |" for k, v in sorted(extra.items())]
    return "\n".join(lines) if lines else "_No metrics yet._"


def _pct(value: float | None) -> str:
    return "" if value is None else f"{100 * value:.1f}%"
