"""Stage `compare` of BridgeVLM: the arms side by side and the paper's claims by the house rule.

Pairs are seeds: every arm trains on the same pairs with the same steps from the same seed, so
arm A's seed k is paired with arm B's seed k; each claim is the paired t 95% CI over seeds with
its MDE (stages/core/stats.py), reproduced / contradicted / inconclusive.

Claims (BridgeVLM, arXiv 2606.11745; spec §1, §4):
- intervention accuracy, BridgeVLM vs prompt-level: paper +21.2 points (33.2 -> 54.4);
- structure F1 (from the yes/no answers), BridgeVLM vs prompt-level: paper +41.7 (33.4 -> 75.1);
- the spec's predicted order: BridgeVLM > answer-only and prompt-level > answer-only on
  intervention; BridgeVLM > prompt-level on counterfactuals (no paper number);
- each ablation loses average accuracy (mean of intervention and counterfactual accuracy):
  no DAG -15.8, no node tokens -12.3, no graph tokens -13.5 points; and, spec §6's placement
  ablation (no paper number), RAMP before the decoder only (`bridgevlm_concat`). `no_node`
  cannot run RAMP inside the decoder (it needs the node tokens: `causal.BridgeVLM`), so its
  claim is against `bridgevlm_concat`, which differs from it in the node tokens only; against
  `bridgevlm` it would mix two removals;
- the DAG is induced, not memorised: BridgeVLM's hard structure F1 of A on the `relay` SCM,
  whose edges no training signal reveals, against the best F1 that a graph ignoring the images
  scores there (the best of the memorised Pendulum graph 2/7, every edge 0.4, no edge 0,
  computed exactly on relay's true graph), **and** the gap of mean A between the two SCMs
  (`a_scm_gap`, the mean over the 12 directed pairs of |mean A on Pendulum - mean A on relay|)
  above `min_scm_gap`. The baseline is a constant, so the "paired" CI of F1 - baseline is the
  one-sample t CI of BridgeVLM's per-seed F1 shifted by it (the constant adds no variance); the
  gap's CI is the one-sample t CI of its per-seed values against `min_scm_gap`. Reproduced
  when both CIs exclude 0 upwards, contradicted when the F1 CI lies below the baseline, else
  inconclusive. The gap is an absolute value, >= 0 by construction: tested against 0, any noise
  would pass (a review found a gap of 0.0001 reported as "reproduced"), hence the threshold
  set in params, [ours] 0.05: more than half of one edge's probability moved between the SCMs
  on average (one edge fully flipped gives 1/12 = 0.083).
- context, not claims: two rules that read the true variable levels of both images (perfect
  perception) and know no graph (`rule_baselines`): intervention = the first variable, in the
  rendered order, whose level changed (right whenever the intervened variable precedes its
  descendants in that order: always on Pendulum, not on relay); counterfactual = the before
  state with X set to v (right whenever X has no descendant whose level changes). An arm below
  them has not learned what a graph adds.
Ten claims are tested at 95% each with no correction: about one in twenty comes out
reproduced or contradicted by chance when there is no effect (the README table says so).
A claim whose method arm learned nothing on its statistic (accuracy within `chance_margin` of
chance in every seed; for structure, one answer to every structure question in every seed) is
**not tested**: it rests on a degenerate part, and the comparison would measure the training
budget, not the method; the README says why. A baseline that learned nothing is still compared
against (the method may beat it).

    python -m stages bridgevlm compare
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from stages.core import stats
from stages.tasks import pendulum

# name -> (method arm, baseline arm, statistic, direction, paper effect, text)
CLAIMS: dict[str, tuple[str, str, str, int, float | None, str]] = {
    "interv_vs_prompt": ("bridgevlm", "prompt_level", "intervention_acc", 1, 0.212,
                         "BridgeVLM > prompt-level, intervention accuracy"),
    "struct_vs_prompt": ("bridgevlm", "prompt_level", "structure_f1", 1, 0.417,
                         "BridgeVLM > prompt-level, structure F1 (answers)"),
    "interv_vs_answer": ("bridgevlm", "answer_only", "intervention_acc", 1, None,
                         "BridgeVLM > answer-only, intervention accuracy"),
    "prompt_vs_answer": ("prompt_level", "answer_only", "intervention_acc", 1, None,
                         "prompt-level > answer-only, intervention accuracy"),
    "cf_vs_prompt": ("bridgevlm", "prompt_level", "cf_acc", 1, None,
                     "BridgeVLM > prompt-level, counterfactual accuracy"),
    "no_dag": ("bridgevlm", "no_dag", "average_acc", 1, 0.158,
               "removing the DAG loses average accuracy"),
    "no_node": ("bridgevlm_concat", "no_node", "average_acc", 1, 0.123,
                "removing node tokens loses average accuracy (against input-concat BridgeVLM: "
                "without node tokens RAMP cannot run in the decoder)"),
    "no_graph": ("bridgevlm", "no_graph", "average_acc", 1, 0.135,
                 "removing graph tokens loses average accuracy"),
    "decoder_ramp": ("bridgevlm", "bridgevlm_concat", "average_acc", 1, None,
                     "RAMP inside the decoder beats input-concat only, average accuracy"),
}
HELD_OUT_SCM, TRAINED_SCM = "relay", "pendulum"
CHANCE = {"intervention_acc": 1 / len(pendulum.VARIABLES), "average_acc": 0.5 / 4,
          "cf_acc": 1 / pendulum.LEVELS ** 3}
COLUMNS = (("intervention_acc", "intervention"), ("cf_acc", "counterfactual"),
           ("structure_acc", "structure acc."), ("structure_f1", "structure F1 (answers)"),
           ("a_f1_soft", "F1 of A, soft"), ("a_f1_hard", "F1 of A, hard"),
           (f"a_f1_hard_{HELD_OUT_SCM}", f"F1 of A, hard, {HELD_OUT_SCM}"),
           ("a_scm_gap", "A gap between SCMs"))


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    data: str = Field("bridgevlm_data", description="path key: the data stage's pairs (the "
                      "rule baselines read the test split's true levels)")
    chance_margin: float = Field(0.05, ge=0, le=1, description="an accuracy within this of "
                                 "chance in every seed counts as 'learned nothing'")
    min_scm_gap: float = Field(0.05, ge=0, le=1, description="[ours] the induction claim's gap "
                               "part: the CI of a_scm_gap must lie above this (module docstring)")


def trivial_f1() -> dict[str, float]:
    """Hard F1 on the held-out SCM's true graph of the graphs that ignore the images (one graph
    for every input): the memorised Pendulum graph, every edge, no edge. On `relay` (3 of 12
    directed edges): 2/7, 2*3/(6+9) = 0.4 and 0."""
    import numpy as np

    from stages.bridgevlm.causal import structure_f1

    k = len(pendulum.VARIABLES)
    truth = pendulum.adjacency(HELD_OUT_SCM)
    graphs = {"memorised": pendulum.adjacency(TRAINED_SCM), "all_edges": 1 - np.eye(k),
              "empty": np.zeros((k, k))}
    return {name: structure_f1(g, truth, hard=True) for name, g in graphs.items()}


def memorised_f1() -> float:
    """F1 of the Pendulum graph read as the held-out SCM's graph."""
    return trivial_f1()["memorised"]


def rule_baselines(rows: Any) -> dict[str, float]:
    """Accuracy of the two graph-free rules on perfect perception (module docstring), overall
    and per SCM: `rule/intervention_acc`, `rule/cf_acc`, `rule/<scm>/...`."""
    def first_changed(r: dict[str, Any]) -> str:
        changed = [k for k, (b, a) in enumerate(zip(r["before"], r["after"])) if b != a]
        if not changed:     # do(X = v) has v != before[X]: something must change
            raise ValueError(f"pair {r.get('id', '?')}: before {r['before']} equals after "
                             f"{r['after']} under do({r['do_var']}): not an intervention pair")
        return pendulum.VARIABLES[changed[0]]

    def copy_and_set(before: list[int], var: str, value: int) -> list[int]:
        out = list(before)
        out[pendulum.VARIABLES.index(var)] = value
        return out

    hits: dict[str, list[tuple[int, int]]] = {}
    for r in rows.iter_rows(named=True):
        interv = int(first_changed(r) == r["do_var"])
        cf = int(copy_and_set(r["before"], r["cf_var"], r["cf_value"]) == list(r["cf_values"]))
        for key in ("", f"{r['scm']}/"):
            hits.setdefault(key, []).append((interv, cf))
    out = {}
    for key, h in hits.items():
        out[f"rule/{key}intervention_acc"] = sum(i for i, _ in h) / len(h)
        out[f"rule/{key}cf_acc"] = sum(c for _, c in h) / len(h)
    return out


def induced_claim(f1: dict[int, float], gap: dict[int, float], baseline: float,
                  min_gap: float) -> tuple[stats.Claim, stats.Claim, int]:
    """(F1 claim, gap claim, verdict) of 'the DAG is induced' (module docstring): F1 of A on
    the held-out SCM against the constant `baseline` (best trivial graph), the gap against the
    constant `min_gap`."""
    c_f1 = stats.claim_by_key(f1, {s: baseline for s in f1})
    c_gap = stats.claim_by_key(gap, {s: min_gap for s in gap})
    if c_f1.verdict == 1 and c_gap.verdict == 1:
        return c_f1, c_gap, 1
    return c_f1, c_gap, -1 if c_f1.verdict == -1 else 0


def per_seed(m: dict[str, Any], arm: str, key: str, seeds: list[int]) -> dict[int, float]:
    return {s: float(m.get(f"seed{s}/{arm}/{key}", math.nan)) for s in seeds}


def learned_nothing(m: dict[str, Any], arm: str, statistic: str, seeds: list[int],
                    margin: float) -> bool:
    """At chance on `statistic` in every seed (structure: one answer to every structure
    question in every seed)."""
    if statistic.startswith("structure"):
        rates = per_seed(m, arm, "struct_yes_rate", seeds).values()
        return all(r in (0.0, 1.0) for r in rates)
    chance = CHANCE.get(statistic)
    if chance is None:
        return False
    return all(v <= chance + margin for v in per_seed(m, arm, statistic, seeds).values())


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    m = ctx.stage_metrics("train")
    arms = sorted({k.split("/")[1] for k in m if k.startswith("seed") and k.count("/") == 2})
    seeds = sorted({int(k.split("/")[0][4:]) for k in m if k.startswith("seed")})
    out: dict[str, float] = {"seeds": float(len(seeds)), "test_pairs": m.get("test_pairs", 0.0),
                             "chance_margin": cfg.chance_margin, "min_scm_gap": cfg.min_scm_gap}
    from stages.core.checks import read_parquet_checked

    test = ctx.path(cfg.data) / "test.parquet"
    out.update(rule_baselines(read_parquet_checked(test, pendulum.expectations(None, "test"))))
    for arm in arms:
        for key, _ in COLUMNS + (("average_acc", ""), ("struct_yes_rate", "")):
            vals = list(per_seed(m, arm, key, seeds).values())
            if stats.finite(vals):
                out[f"{arm}/{key}_mean"], out[f"{arm}/{key}_std"] = stats.mean_std(vals)
    for name, (method, base, statistic, direction, paper, _) in CLAIMS.items():
        if method not in arms or base not in arms:
            print(f"compare: {name}: skipped (arm {method if method not in arms else base} "
                  f"not trained)")
            continue
        if learned_nothing(m, method, statistic, seeds, cfg.chance_margin):
            out[f"claim/{name}/not_tested"] = 1.0
            print(f"compare: {name}: not tested ({method} learned nothing on {statistic})")
            continue
        c = stats.claim_by_key(per_seed(m, method, statistic, seeds),
                               per_seed(m, base, statistic, seeds), direction=direction,
                               paper_effect=paper)
        out.update(stats.claim_metrics(c, f"claim/{name}"))
        print(f"compare: {name}: {c.sentence()}")
    trivial = trivial_f1()
    out["memorised_f1"] = trivial["memorised"]
    out.update({f"trivial_f1/{name}": v for name, v in trivial.items()})
    out["trivial_f1_best"] = max(trivial.values())
    if "bridgevlm" in arms:
        held = per_seed(m, "bridgevlm", f"a_f1_hard_{HELD_OUT_SCM}", seeds)
        gap = per_seed(m, "bridgevlm", "a_scm_gap", seeds)
        if stats.finite(list(held.values())):
            c_f1, c_gap, v = induced_claim(held, gap, out["trivial_f1_best"], cfg.min_scm_gap)
            # one claim (one verdict) in the metrics: the F1 CI, the combined verdict, and
            # the gap's CI beside it under keys that do not end in /verdict
            out.update(stats.claim_metrics(c_f1, "claim/induced"))
            out["claim/induced/verdict"] = float(v)
            out.update({f"claim/induced/{k}": x for k, x in
                        (("gap_diff", c_gap.diff), ("gap_ci_low", c_gap.low),
                         ("gap_ci_high", c_gap.high), ("gap_pairs", float(c_gap.n)),
                         ("f1_verdict", float(c_f1.verdict)),
                         ("gap_verdict", float(c_gap.verdict))) if math.isfinite(x)})
            print(f"compare: induced: {stats.VERDICTS[v]} (F1 vs best trivial "
                  f"{out['trivial_f1_best']:.3f}: {c_f1.sentence()}; A gap - threshold: "
                  f"{c_gap.sentence()}, threshold {cfg.min_scm_gap:g})")
    return out


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: verdict counts and the number of claims not tested."""
    out = stats.verdict_counts(metrics)
    out["not_tested"] = float(sum(1 for k in metrics if k.endswith("/not_tested")))
    return out


def _cell(m: dict[str, Any], key: str) -> str:
    mean, std = m.get(f"{key}_mean"), m.get(f"{key}_std")
    if mean is None or not math.isfinite(mean):
        return "—"
    return f"{mean:.3f} ± {std:.3f}" if int(m.get("seeds", 1)) > 1 else f"{mean:.3f}"


def results_table(metrics: dict[str, dict[str, Any]]) -> str:
    """The README block of `paperline report bridgevlm`: arms, then every claim."""
    m = metrics.get("compare", {})
    arms = sorted({k.split("/")[0] for k in m if k.endswith("/intervention_acc_mean")})
    if not arms:
        return "_No results yet: run the pipeline._\n"
    known = ("answer_only", "prompt_level", "bridgevlm", "bridgevlm_concat", "no_dag",
             "no_node", "no_graph", "oracle")
    order = [a for a in known if a in arms] + [a for a in arms if a not in known]
    lines = [f"Test split ({int(m.get('test_pairs', 0))} pairs, both SCMs), mean ± std over "
             f"{int(m.get('seeds', 0))} seeds. Structure F1 (answers) pools the yes/no "
             f"structure questions (half are edges: always answering yes scores 0.667). F1 of "
             f"A: the induced soft DAG after Hungarian node ↔ variable alignment, mean of the "
             f"two SCMs' per-pair F1 (hard: A ≥ 0.5); no training signal reveals "
             f"`{HELD_OUT_SCM}`'s edges (no structure question, graph text or edge / graph "
             f"loss on its rows).", "",
             "| arm | " + " | ".join(label for _, label in COLUMNS) + " |",
             "|---|" + "---|" * len(COLUMNS)]
    for arm in order:
        lines.append(f"| {arm} | " + " | ".join(_cell(m, f"{arm}/{k}") for k, _ in COLUMNS)
                     + " |")
    if "rule/intervention_acc" in m:
        rule = {"intervention_acc": m["rule/intervention_acc"], "cf_acc": m["rule/cf_acc"]}
        lines.append("| *rule: perfect perception, no graph* | " + " | ".join(
            f"*{rule[k]:.3f}*" if k in rule else "" for k, _ in COLUMNS) + " |")
        lines += ["", "The rule row (context, not an arm): the true levels of both images and "
                  "no graph; intervention = the first variable, in the rendered order, whose "
                  "level changed; counterfactual = the before state with X set to v. By SCM: "
                  + "; ".join(f"{scm} {m.get(f'rule/{scm}/intervention_acc', math.nan):.3f} / "
                              f"{m.get(f'rule/{scm}/cf_acc', math.nan):.3f}"
                              for scm in (TRAINED_SCM, HELD_OUT_SCM)) + "."]
    lines += ["", "| claim | paired 95% CI over seeds (points as fractions) |", "|---|---|"]
    for name, (method, base, statistic, *_rest, text) in CLAIMS.items():
        c = stats.read_claim(m, f"claim/{name}")
        if c is not None:
            lines.append(f"| {text} | {c.sentence()} |")
        elif m.get(f"claim/{name}/not_tested"):
            why = ("gives one answer to every structure question in every seed"
                   if statistic.startswith("structure") else
                   f"is within {m.get('chance_margin', math.nan):.2f} of chance on {statistic} "
                   f"in every seed")
            lines.append(f"| {text} | **not tested**: {method} {why}: it learned nothing here at "
                         f"this budget, so the comparison would measure the budget, not the "
                         f"method |")
    c = stats.read_claim(m, "claim/induced")
    if c is not None:
        gap = [m.get(f"claim/induced/gap_{k}", math.nan) for k in ("diff", "ci_low", "ci_high")]
        g = ["n/a" if not math.isfinite(x) else f"{x:.3f}" for x in gap]

        def part(key: str) -> str:
            v = m.get(f"claim/induced/{key}")
            return "n/a" if v is None else stats.VERDICTS[int(v)]
        lines.append(f"| the DAG is induced: F1 of A on `{HELD_OUT_SCM}` > the best graph "
                     f"that ignores the images ({m.get('trivial_f1_best', math.nan):.3f}: "
                     f"memorised Pendulum {m.get('memorised_f1', math.nan):.3f}, every edge "
                     f"{m.get('trivial_f1/all_edges', math.nan):.3f}, no edge "
                     f"{m.get('trivial_f1/empty', math.nan):.3f}; one-sample t CI, the "
                     f"baseline is a constant) and mean-A gap between the SCMs > "
                     f"{m.get('min_scm_gap', math.nan):g} | "
                     f"{c.sentence()} (F1 - baseline: {part('f1_verdict')}); A gap - "
                     f"{m.get('min_scm_gap', math.nan):g}: "
                     f"{g[0]} [{g[1]}, {g[2]}] ({part('gap_verdict')}) |")
    lines += ["", "Ten claims at 95% each, with no correction for multiplicity: with no effect "
              "anywhere, about one in twenty would still come out reproduced or contradicted. "
              "A verdict whose CI bound sits at ±0.000 is the weakest kind.", ""]
    return "\n".join(lines)
