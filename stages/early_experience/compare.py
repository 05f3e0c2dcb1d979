"""Stage `compare`: Early Experience's predicted directions vs imitation learning, by the house
claim rule (stages.core.stats: paired 95% t CI over the training seeds of the difference in
success rate; every arm played the same goals, so each seed's pair is also paired per episode).

    iwm_vs_il, sr_vs_il             in-domain: IWM > IL and SR > IL; the paper's WebShop with
                                    Llama-3.1-8B: IL 47.3, IWM 58.6, SR 58.2 [secondary]
    iwm_vs_il_ood, sr_vs_il_ood     the same on the OOD goals; the paper's average OOD gain over
                                    IL is +9.4 points [secondary]. The shop has two OOD splits
                                    (the spec's "unseen categories and constraint
                                    combinations"): `ood` (unseen category words) and, as
    iwm_vs_il_ood_combo, ...        `ood_combo`, unseen (colour, category) pairs of seen words
    iwm_vs_dpo, sr_vs_dpo           "DPO is weaker than IWM and SR" [secondary]
    il_vs_random                    [ours] the imitation policy beats the random floor (it
                                    learned something at all)
    babyai_<claim>                  (with `babyai` in `worlds`) every claim above on BabyAI
                                    (stages.early_experience.babyai): the same predicted
                                    directions; the paper has no BabyAI number
    <arm>_f<f>_vs_il                (with train.fractions) early experience on the smallest
                                    fraction of the demonstrations vs IL on all of them; "with
                                    1/8 of the demonstrations, early experience beats full-data
                                    IL on WebShop" [secondary]
    <arm>_vs_il_f<f>                [ours] the same arms both on that smallest fraction: does
                                    early experience help where demonstrations are scarce
    iwm_vs_iwm_k<K>                 (with train.k_sweep) IWM at the main K vs at the smallest
                                    swept K below it; "IWM improves steadily with K" [secondary]
                                    (SR "peaks at K = 2-4": no direction to test against K = 1)
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from stages.core import stats

CLAIMS = {  # name: (method setting, baseline setting, split, paper effect)
    "iwm_vs_il": ("iwm", "il", "test", 0.113),
    "sr_vs_il": ("sr", "il", "test", 0.109),
    "iwm_vs_il_ood": ("iwm", "il", "ood", 0.094),
    "sr_vs_il_ood": ("sr", "il", "ood", 0.094),
    "iwm_vs_il_ood_combo": ("iwm", "il", "ood_combo", 0.094),
    "sr_vs_il_ood_combo": ("sr", "il", "ood_combo", 0.094),
    "iwm_vs_dpo": ("iwm", "dpo", "test", None),
    "sr_vs_dpo": ("sr", "dpo", "test", None),
}


# world -> (its evaluate stage, its world stage with the floor, claim-name prefix)
WORLDS = {"shop": ("evaluate", "shop", ""), "babyai": ("babyai_evaluate", "babyai", "babyai_")}
TRAIN = {"shop": "train", "babyai": "babyai_train"}     # the stage that trained its policies


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    worlds: list[Literal["shop", "babyai"]] = Field(
        default_factory=lambda: ["shop"], min_length=1, description="environments compared")


def seeds_of(m: dict[str, float]) -> list[int]:
    return sorted({int(k.split("/")[1][1:]) for k in m
                   if k.startswith("il/s") and k.endswith("/success_test") and k.count("/") == 2})


def per_seed(m: dict[str, float], setting: str, split: str, seeds: list[int]
             ) -> dict[int, float] | None:
    keys = {s: f"{setting}/s{s}/success_{split}" for s in seeds}
    if not all(k in m for k in keys.values()):
        return None
    return {s: m[k] for s, k in keys.items()}


def fractions_of(m: dict[str, float]) -> list[float]:
    return sorted({float(k.split("/")[0].split("@f")[1]) for k in m
                   if "@f" in k.split("/")[0]})


def ks_of(m: dict[str, float]) -> list[int]:
    """The swept K of the `<arm>@k<K>` settings (the main K is the plain `<arm>`)."""
    return sorted({int(k.split("/")[0].split("@k")[1]) for k in m if "@k" in k.split("/")[0]})


def claim_label(name: str, main_k: int) -> str:
    """The README's words for a claim name of `world_claims`."""
    if name in NAMES:
        return NAMES[name]
    if m := re.fullmatch(r"(iwm|sr)_f([0-9.]+)_vs_il", name):
        return f"{m[1].upper()} on {m[2]} of the demonstrations > IL on all"
    if m := re.fullmatch(r"(iwm|sr)_vs_il_f([0-9.]+)", name):
        return f"[ours] {m[1].upper()} > IL, both on {m[2]} of the demonstrations"
    if m := re.fullmatch(r"(iwm|sr)_vs_\1_k([0-9]+)", name):
        return f"{m[1].upper()} at K = {main_k or 'main'} > at K = {m[2]}"
    return name


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for world in cfg.worlds:
        stage, floor_stage, prefix = WORLDS[world]
        main_k = ctx.stage_metrics(TRAIN[world]).get("il/k")
        got = world_claims(ctx.stage_metrics(stage), ctx.stage_metrics(floor_stage), stage,
                           paper_effects=world == "shop",
                           main_k=None if main_k is None else int(main_k))
        out.update({k.replace("claim/", f"claim/{prefix}", 1) if prefix else k: v
                    for k, v in got.items() if k != "seeds"})
        out[f"{prefix}seeds"] = got["seeds"]
    return out


def world_claims(m: dict[str, float], floor: dict[str, float], stage: str, *,
                 paper_effects: bool = True, main_k: int | None = None) -> dict[str, float]:
    """The claims of one environment from its evaluate and world stages' metrics (the paper's
    WebShop effects beside the mini-WebShop's claims only: it reports no BabyAI number).
    `main_k`: the K of the main setting (the K claim compares it with a smaller swept K)."""
    seeds = seeds_of(m)
    if len(seeds) < 2:
        raise ValueError(f"compare: {len(seeds)} seed(s) in details/{stage}.json; paired CIs "
                         "need at least 2")
    out: dict[str, float] = {"seeds": float(len(seeds))}
    claims = dict(CLAIMS)
    fr = fractions_of(m)
    if fr:
        f = fr[0]
        for arm in ("iwm", "sr"):
            claims[f"{arm}_f{f:g}_vs_il"] = (f"{arm}@f{f:g}", "il", "test", None)
            claims[f"{arm}_vs_il_f{f:g}"] = (f"{arm}@f{f:g}", f"il@f{f:g}", "test", None)
    below = [k for k in ks_of(m) if main_k is not None and k < main_k]
    if below:               # "improves with K": the main K against the least K swept below it
        claims[f"iwm_vs_iwm_k{below[0]}"] = ("iwm", f"iwm@k{below[0]}", "test", None)
    for name, (method, base, split, effect) in claims.items():
        a, b = per_seed(m, method, split, seeds), per_seed(m, base, split, seeds)
        if a is None or b is None:
            continue                      # an arm not run at this profile
        c = stats.claim_by_key(a, b, paper_effect=effect if paper_effects else None)
        out.update(stats.claim_metrics(c, f"claim/{name}"))
    il = per_seed(m, "il", "test", seeds)
    assert il is not None
    c = stats.claim_by_key(il, {s: floor["random/test/success"] for s in seeds})
    out.update(stats.claim_metrics(c, "claim/il_vs_random"))
    return out


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: how many of the pipeline's claims, both worlds' together, are reproduced,
    inconclusive and contradicted (`dvc metrics show` stays one short table); the README block
    and details/compare.json give every claim per world."""
    return stats.verdict_counts(metrics)


ARMS_SHOWN = (("il", "IL (imitation)"), ("iwm", "IWM -> IL"), ("sr", "SR + IL (templated)"),
              ("dpo", "IL -> DPO"))
NAMES = {"iwm_vs_il": "IWM > IL, in-domain", "sr_vs_il": "SR > IL, in-domain",
         "iwm_vs_il_ood": "IWM > IL, OOD", "sr_vs_il_ood": "SR > IL, OOD",
         "iwm_vs_il_ood_combo": "IWM > IL, OOD (unseen combinations)",
         "sr_vs_il_ood_combo": "SR > IL, OOD (unseen combinations)",
         "iwm_vs_dpo": "IWM > DPO", "sr_vs_dpo": "SR > DPO",
         "il_vs_random": "[ours] IL > random (learned at all)"}


def results_table(metrics: dict[str, dict[str, Any]]) -> str:
    """README block, per environment: success per arm in-domain and OOD with the ceiling and
    floor, the data-efficiency and K tables when run, and the claims."""
    c = metrics.get("compare", {})
    if not any(k.startswith("claim/") for k in c) or \
            "expert/test/success" not in metrics.get("shop", {}):
        return "_No results yet: run the pipeline._\n"
    out = world_table(metrics, "shop")
    if "babyai_seeds" in c and "expert/test/success" in metrics.get("babyai", {}):
        out += "\n### BabyAI\n\n" + world_table(metrics, "babyai")
    return out


def world_table(metrics: dict[str, dict[str, Any]], world: str) -> str:
    stage, floor_stage, prefix = WORLDS[world]
    e, s = metrics.get(stage, {}), metrics.get(floor_stage, {})
    others = tuple(f"claim/{p}" for _, _, p in WORLDS.values() if p and p != prefix)
    c = {k.replace(f"claim/{prefix}", "claim/", 1): v for k, v in metrics["compare"].items()
         if k.startswith(f"claim/{prefix}") and not k.startswith(others)}
    train = metrics.get(TRAIN[world], {})
    ood = "OOD (a key as the target)" if world == "babyai" else "OOD (unseen categories)"
    expert = "BabyAIBot (the ceiling)" if world == "babyai" else "expert (scripted, the ceiling)"
    seeds = seeds_of(e)

    def f(d: dict[str, Any], key: str) -> str:
        v = d.get(key, math.nan)
        return "-" if not isinstance(v, (int, float)) or math.isnan(v) else f"{v:.3f}"

    def sd(setting: str, split: str) -> str:
        vals = per_seed(e, setting, split, seeds)
        if not vals:
            return "-"
        mean, std = stats.mean_std(list(vals.values()))
        return f"{mean:.3f} ± {std:.3f}"

    splits = ["test", "ood"] + (["ood_combo"] if "expert/ood_combo/success" in s else [])
    heads = {"test": "in-domain", "ood": ood,
             "ood_combo": "OOD (unseen colour × category)"}
    lines = [f"**Success rate** (mean ± std over {len(seeds)} training seeds; the same goals "
             "for every arm; every learned arm at the same number of updates):", "",
             "| arm | " + " | ".join(heads[x] for x in splits) + " | parse failures / turn |",
             "|---|" + "---|" * (len(splits) + 1),
             f"| {expert} | " + " | ".join(f(s, f"expert/{x}/success") for x in splits)
             + " | - |"]
    for arm, label in ARMS_SHOWN:
        if f"{arm}/success_test" in e:
            lines.append(f"| {label} | " + " | ".join(sd(arm, x) for x in splits)
                         + f" | {f(e, arm + '/parse_failure_rate')} |")
    lines.append("| random (the floor) | " + " | ".join(f(s, f"random/{x}/success")
                                                         for x in splits) + " | - |")
    fr = fractions_of(e)
    if fr:
        cols = [*fr, 1.0]
        lines += ["", "**Data efficiency** (in-domain success, mean ± std over the seeds, by "
                  "share of the demonstrations; every setting at the same number of updates):",
                  "", "| arm | " + " | ".join(f"{x:g}" for x in cols) + " |",
                  "|---|" + "---|" * len(cols)]
        for arm, label in ARMS_SHOWN:
            if any(f"{arm}@f{x:g}/success_test" in e for x in fr):
                lines.append(f"| {label} | " + " | ".join(
                    sd(arm if x == 1.0 else f"{arm}@f{x:g}", "test")
                    for x in cols) + " |")
    ks = ks_of(e)
    main_k = int(train.get("il/k", 0) or 0)
    if ks:
        cols = sorted({*ks, main_k} - {0})
        lines += ["", "**K alternatives per state** (in-domain success, mean ± std over the "
                  "seeds):", "",
                  "| arm | " + " | ".join(f"K={k}" for k in cols) + " |",
                  "|---|" + "---|" * len(cols)]
        for arm, label in ARMS_SHOWN:
            if arm in ("iwm", "sr") and any(f"{arm}@k{k}/success_test" in e for k in ks):
                lines.append(f"| {label} | " + " | ".join(
                    sd(arm if k == main_k else f"{arm}@k{k}", "test")
                    for k in cols) + " |")
    lines += ["", "**Claims** (paired 95% CI over training seeds of the success difference):",
              ""]
    extra = [k.split("/")[1] for k in c if k.endswith("/verdict")
             and k.split("/")[1] not in NAMES]
    for name in [*NAMES, *extra]:
        cl = stats.read_claim(c, f"claim/{name}")
        if cl is not None:
            lines.append(f"- {claim_label(name, main_k)}: {cl.sentence()}")
    return "\n".join(lines) + "\n"
