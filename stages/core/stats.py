"""The statistics every `compare` stage shares: spreads, ranks, paired CIs, budgets, and the one
claim rule that says whether a paper's claim is reproduced here.

The claim rule (house rule, applied the same way in every pipeline):

- **reproduced**: the paired 95% CI of (method - baseline) excludes 0 in the paper's direction;
- **contradicted**: it excludes 0 the other way;
- **inconclusive**: neither. Where the CI holds 0 but excludes the paper's claimed effect, the
  claim stays inconclusive and says so (`Claim.excludes_paper_effect`): the effect here, if any,
  is smaller than the paper's, which is a finding about size, not evidence against the
  direction. (An earlier version called that case contradicted, against the project's rule.)

Every verdict is reported with the minimum detectable effect (MDE) of this run: the true
difference that a paired two-sided 5% test would detect with 80% power, at this run's number of
pairs and spread of the differences, (t_{0.975, n-1} + t_{0.80, n-1}) * sd(d) / sqrt(n). Set beside
the paper's effect it tells a reader whether "inconclusive" means "no effect" (MDE well below the
paper's effect) or "too few seeds to see one" (MDE above it).

Paired CIs: over seeds (a handful of pairs) the t interval, mean(d) +- t_{0.975, n-1} sd(d)/sqrt(n);
a percentile bootstrap over three or four pairs would exclude 0 whenever all differences share a
sign, which is not evidence. Over many pairs (problems, prompts) the percentile bootstrap, which
needs no normality (`paired_ci(..., method="bootstrap")`).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Sequence

VERDICTS = {1: "reproduced", 0: "inconclusive", -1: "contradicted"}


def verdict_counts(m: Mapping[str, Any]) -> dict[str, float]:
    """How many claims in `m` (every `<prefix>/verdict` that `claim_metrics` wrote) are
    reproduced, inconclusive and contradicted: a compare stage's DVC headline (each claim's
    numbers stay in its details file and the README)."""
    counts = {name: 0.0 for name in VERDICTS.values()}
    for key, value in m.items():
        if (key.endswith("/verdict") and isinstance(value, (int, float))
                and math.isfinite(value) and int(value) in VERDICTS):
            counts[VERDICTS[int(value)]] += 1
    return counts


def finite(values: Sequence[float]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(v)]


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and population std (ddof 0: the seeds run are the whole population reported) over
    the finite values; (NaN, NaN) when none is left."""
    vals = finite(values)
    if not vals:
        return math.nan, math.nan
    mean = sum(vals) / len(vals)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))


def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing their average rank (scipy's 'average' method)."""
    from scipy.stats import rankdata

    return [float(r) for r in rankdata(list(values), method="average")]


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson r; NaN when either side is constant or has fewer than two values."""
    if len(x) != len(y):
        raise ValueError(f"{len(x)} x values but {len(y)} y values")
    n = len(x)
    if n < 2:
        return math.nan
    mx, my = sum(x) / n, sum(y) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(x, y))
    vx = sum((a - mx) ** 2 for a in x)
    vy = sum((b - my) ** 2 for b in y)
    return cov / math.sqrt(vx * vy) if vx > 0 and vy > 0 else math.nan


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rho (Pearson r of the tie-averaged ranks); pairs with a non-finite value are
    dropped; NaN when fewer than two pairs are left or either side is constant."""
    if len(x) != len(y):
        raise ValueError(f"{len(x)} x values but {len(y)} y values")
    pairs = [(a, b) for a, b in zip(x, y) if math.isfinite(a) and math.isfinite(b)]
    if len(pairs) < 2:
        return math.nan
    return pearson(ranks([a for a, _ in pairs]), ranks([b for _, b in pairs]))


def percentile_ci(n: int, statistic: Callable[[list[int]], float], draws: int, seed: int = 0
                  ) -> tuple[float, float]:
    """Percentile 95% bootstrap CI of `statistic(indices)` over `draws` resamples of range(n)
    with replacement; resamples where the statistic is NaN are dropped."""
    rng = random.Random(seed)
    vals = []
    for _ in range(draws):
        v = statistic([rng.randrange(n) for _ in range(n)])
        if math.isfinite(v):
            vals.append(v)
    if not vals:
        return math.nan, math.nan
    vals.sort()
    return vals[int(0.025 * (len(vals) - 1))], vals[int(0.975 * (len(vals) - 1))]


def paired_ci(a: Sequence[float], b: Sequence[float], *, method: Literal["t", "bootstrap"] = "t",
              draws: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(mean of a_i - b_i, 95% CI low, high) over paired values (same seed / problem on both
    sides). `t`: the t interval (few pairs, e.g. seeds); `bootstrap`: the percentile bootstrap of
    the mean difference, resampling pairs (many pairs). One pair: (d, NaN, NaN). Identical
    differences (e.g. one more test prompt right on every seed) have no spread: both intervals
    collapse to the point d and would call it certain from as few as two pairs. Then the exact
    sign test decides instead: n equal-signed pairs exclude 0 at 5% only when 2 * 0.5^n < 0.05,
    i.e. n >= 6 (the point interval is kept); with fewer there is no interval (NaN bounds: the
    verdict is inconclusive)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"a paired CI needs two equally long non-empty lists, got {len(a)} and "
                         f"{len(b)} values")
    d = [x - y for x, y in zip(a, b)]
    n = len(d)
    mean = sum(d) / n
    if n < 2 or (all(x == d[0] for x in d) and 2 * 0.5 ** n >= 0.05):
        return mean, math.nan, math.nan
    if method == "bootstrap":
        rng = random.Random(seed)
        means = sorted(sum(d[rng.randrange(n)] for _ in range(n)) / n for _ in range(draws))
        return mean, means[int(0.025 * (draws - 1))], means[int(0.975 * (draws - 1))]
    if method != "t":
        raise ValueError(f"paired_ci method must be 't' or 'bootstrap', not {method!r}")
    from scipy.stats import t

    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    half = float(t.ppf(0.975, n - 1)) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def mde(diffs: Sequence[float], power: float = 0.8) -> float:
    """Minimum detectable effect of a paired two-sided 5% t test at `power`, from the observed
    differences: (t_{0.975, n-1} + t_{power, n-1}) * sd(d) / sqrt(n). NaN with fewer than 2."""
    d = finite(diffs)
    n = len(d)
    if n < 2:
        return math.nan
    from scipy.stats import t

    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    return (float(t.ppf(0.975, n - 1)) + float(t.ppf(power, n - 1))) * sd / math.sqrt(n)


def verdict(low: float, high: float, direction: int = 1) -> int:
    """+1 reproduced, -1 contradicted, 0 inconclusive (module docstring). `direction` is +1 when
    the paper says the method's value is higher than the baseline's, -1 when lower."""
    if direction not in (1, -1):
        raise ValueError(f"direction must be +1 or -1, not {direction!r}")
    if not (math.isfinite(low) and math.isfinite(high)):
        return 0
    if (low > 0 and direction > 0) or (high < 0 and direction < 0):
        return 1
    if (high < 0 and direction > 0) or (low > 0 and direction < 0):
        return -1
    return 0


def noninferiority(low: float, high: float, margin: float, direction: int = 1) -> int:
    """The claim rule for a paper that says the method does *not lose* to the baseline ("POPE
    F1 does not fall"), on the paired 95% CI [low, high] of (method - baseline), with the same
    codes as `verdict`: +1 reproduced when the whole CI lies above -margin (any loss is smaller
    than the margin), -1 contradicted when the whole CI lies below -margin (a loss larger than
    the margin), 0 inconclusive otherwise (or with no CI). `direction` -1 is for a value where
    lower is better: the bounds are mirrored (+margin). The margin is the largest loss taken as
    'no loss'; it is set before the run, in params.yaml, never from the data."""
    if direction not in (1, -1):
        raise ValueError(f"direction must be +1 or -1, not {direction!r}")
    if not (math.isfinite(margin) and margin >= 0):
        raise ValueError(f"a non-inferiority margin must be a finite number >= 0, got {margin!r}")
    if not (math.isfinite(low) and math.isfinite(high)):
        return 0
    low, high = (low, high) if direction > 0 else (-high, -low)
    if low > -margin:
        return 1
    if high < -margin:
        return -1
    return 0


@dataclass(frozen=True)
class Claim:
    """One claim tested on paired values: the difference, its CI, the verdict and the MDE."""

    diff: float
    low: float
    high: float
    verdict: int
    mde: float
    n: int
    paper_effect: float | None = None

    @property
    def name(self) -> str:
        return VERDICTS[self.verdict]

    @property
    def excludes_paper_effect(self) -> bool:
        """The CI lies wholly on one side of the paper's claimed effect (whatever the verdict)."""
        p = self.paper_effect
        return (p is not None and math.isfinite(p) and math.isfinite(self.low)
                and math.isfinite(self.high) and not self.low <= p <= self.high)

    def metrics(self, prefix: str) -> dict[str, float]:
        """Flat DVC metrics: <prefix>/diff, ci_low, ci_high, mde, pairs, verdict (+1/0/-1)."""
        return {f"{prefix}/diff": self.diff, f"{prefix}/ci_low": self.low,
                f"{prefix}/ci_high": self.high, f"{prefix}/mde": self.mde,
                f"{prefix}/pairs": float(self.n), f"{prefix}/verdict": float(self.verdict)}

    @classmethod
    def from_metrics(cls, m: dict[str, Any], prefix: str, paper_effect: float | None = None
                     ) -> "Claim | None":
        if f"{prefix}/verdict" not in m:
            return None
        return cls(m[f"{prefix}/diff"], m[f"{prefix}/ci_low"], m[f"{prefix}/ci_high"],
                   int(m[f"{prefix}/verdict"]), m[f"{prefix}/mde"], int(m[f"{prefix}/pairs"]),
                   paper_effect)

    def sentence(self, fmt: str = "{:+.3f}") -> str:
        """'**inconclusive**: +0.012 [-0.020, +0.044] over 3 pairs; MDE 0.051 (paper: +0.050)'."""
        def f(v: float | None) -> str:
            return "n/a" if v is None or not math.isfinite(v) else fmt.format(v)
        paper = f"; paper: {f(self.paper_effect)}" if self.paper_effect is not None else ""
        if self.verdict == 0 and self.excludes_paper_effect:
            paper += " (outside the CI)"
        mde_text = "n/a" if not math.isfinite(self.mde) else fmt.format(self.mde).lstrip("+")
        return (f"**{self.name}**: {f(self.diff)} [{f(self.low)}, {f(self.high)}] over "
                f"{self.n} pairs; MDE {mde_text}{paper}")


def claim(method: Sequence[float], baseline: Sequence[float], *, direction: int = 1,
          paper_effect: float | None = None, method_ci: Literal["t", "bootstrap"] = "t",
          draws: int = 2000, seed: int = 0) -> Claim:
    """Test 'method beats baseline in the paper's direction' on paired values (module docstring)."""
    diff, low, high = paired_ci(method, baseline, method=method_ci, draws=draws, seed=seed)
    d = [x - y for x, y in zip(method, baseline)]
    return Claim(diff, low, high, verdict(low, high, direction), mde(d), len(d), paper_effect)


def claim_from_ci(diff: float, low: float, high: float, *, diffs: Sequence[float] = (),
                  n: int | None = None, direction: int = 1,
                  paper_effect: float | None = None, mde_value: float | None = None) -> Claim:
    """The same rule for a CI computed elsewhere (e.g. a bootstrap of a correlation difference)."""
    m = mde_value if mde_value is not None else mde(diffs)
    return Claim(diff, low, high, verdict(low, high, direction), m,
                 n if n is not None else len(diffs), paper_effect)


def check_budgets(budgets: dict[str, dict[str, Any]], keys: Sequence[str]) -> None:
    """Raise ValueError naming the arm and the key when arms ran at different budgets: a method
    is compared with its baselines only at the same budget."""
    if not budgets:
        return
    first_arm, first = next(iter(budgets.items()))
    for arm, budget in budgets.items():
        for key in keys:
            if budget.get(key) != first.get(key):
                raise ValueError(f"arm {arm!r} ran with {key} = {budget.get(key)!r} but "
                                 f"{first_arm!r} with {first.get(key)!r}: budgets must be equal "
                                 f"(set it in the shared anchor of params.yaml)")


def claim_by_key(method: Mapping[Any, float], baseline: Mapping[Any, float], *,
                 direction: int = 1, paper_effect: float | None = None,
                 relative: bool = False) -> Claim:
    """`claim` on values paired by key (the seed: the same seed on both sides).

    Both sides must hold the same keys (ValueError naming those on one side only). A pair with
    a non-finite value on either side is dropped (a seed where the metric is undefined, e.g.
    tokens per solved query when none is solved); with no pair left the claim is inconclusive
    over 0 pairs. `relative`: differences relative to the baseline's mean over the pairs,
    (m_i - b_i) / mean(b), for a paper that states a relative effect ("+17%", "50% fewer
    rollouts"), `paper_effect` then relative too. Dividing by a positive constant moves no CI
    bound across 0, so only the comparison with the paper's effect changes; a baseline mean
    <= 0 has no relative change: inconclusive."""
    if set(method) != set(baseline):
        only = sorted(set(method) ^ set(baseline), key=str)
        raise ValueError(f"paired values need the same keys (seeds) on both sides; on one side "
                         f"only: {only}")
    pairs = [(float(method[k]), float(baseline[k])) for k in sorted(method)]
    pairs = [(m, b) for m, b in pairs if math.isfinite(m) and math.isfinite(b)]
    undecided = Claim(math.nan, math.nan, math.nan, 0, math.nan, len(pairs), paper_effect)
    verdict(0.0, 0.0, direction)                          # a bad direction fails here too
    if not pairs:
        return undecided
    m, b = [p[0] for p in pairs], [p[1] for p in pairs]
    if relative:
        base = sum(b) / len(b)
        if not base > 0:
            return undecided
        m, b = [v / base for v in m], [v / base for v in b]
    return claim(m, b, direction=direction, paper_effect=paper_effect)


def claim_metrics(c: Claim, prefix: str) -> dict[str, float]:
    """`Claim.metrics` plus `<prefix>/paper_effect` (when the paper gives one), less the
    non-finite values (a CI over one pair, a relative change over a zero baseline): DVC metrics
    stay plain numbers, and a README table rendered from the metrics alone can set the paper's
    effect beside the MDE. `read_claim` reads it back."""
    out = c.metrics(prefix)
    if c.paper_effect is not None:
        out[f"{prefix}/paper_effect"] = float(c.paper_effect)
    return {k: v for k, v in out.items() if math.isfinite(v)}


def read_claim(m: Mapping[str, Any], prefix: str) -> Claim | None:
    """The claim `claim_metrics` wrote under `prefix`, dropped values back as NaN; None when
    there is none."""
    if f"{prefix}/verdict" not in m:
        return None

    def get(key: str) -> float:
        return float(m.get(f"{prefix}/{key}", math.nan))

    paper = m.get(f"{prefix}/paper_effect")
    return Claim(get("diff"), get("ci_low"), get("ci_high"), int(m[f"{prefix}/verdict"]),
                 get("mde"), int(m.get(f"{prefix}/pairs", 0)),
                 None if paper is None else float(paper))
