"""Stages `judge`, `genselect`, `hybrid` and `hybrid_lenient` of ProofVerify: pick one of n_p
candidates per problem (arXiv 2511.13027, §2).

One module, four params sections (`method` names the rule); every verifier call goes through
the LLM backend (`stages/models/backend.py`), so the `gpu` profile swaps the tiny fine-tuned
verifiers for prompted served models by params alone.

- `judge` (pure LLM-as-a-Judge): n_j sampled verdicts for EVERY candidate; s = #Yes/#parseable
  (-1 if none parses); argmax after a shuffle. Calls: n_p x n_j. Every verdict is cached in
  `votes.parquet` (the paper caches every LLM call), with its raw text.
- `genselect` (pure GenSelect): knockout to one winner. Calls: n_p - 1 games.
- `hybrid`: knockout to `winner_count` = n_s survivors, then the argmax over the survivors of
  mean_{j=1..n_j} 1[Yes] over their first n_j cached verdicts of the `judge` stage (the same
  verdicts the pure judge saw: a paired comparison); an unparseable verdict counts as not Yes
  (`survivor_score: all`, the paper's rule). Calls: n_p - n_s games + n_s x n_j.
- `hybrid_lenient` (ablation [ours]): the same knockout (same seeds, same games), survivors
  scored by the judge's #Yes / #parseable (`survivor_score: parseable`), so one Yes among
  unparseable replies scores 1.

Malformed outputs never stop a run: for the judge an unparseable verdict is None (left out of s;
a candidate with no parseable verdict scores -1), an unparseable game has a uniformly random
winner (paper §2; NeMo-Skills recipe). Their rates are reported (`parse_fail_rate`). Seeds:
each seed redraws the verdict samples, the tournament shuffles and the tie-breaking shuffles.

    <out>/selections.parquet   seed, problem_id, selected candidate, calls, parse failures
    <out>/votes.parquet        (judge) seed, candidate_id, vote, verdict, text
    <out>/games.parquet        (genselect, hybrid) seed, problem_id, round, first, second, choice

    python -m stages proofverify judge | genselect | hybrid | hybrid_lenient
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable, Literal, Sequence

import polars as pl
from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.core.checks import read_json_checked
from stages.core import io
from stages.models.backend import BackendConfig, make_backend
from stages.proofverify import proofverify as pv

SELECTIONS: dict[str, Any] = {
    "method": pl.String, "seed": pl.Int64, "problem_id": pl.String,
    "selected_id": pl.String, "calls": pl.Int64, "games": pl.Int64,
    "judgements": pl.Int64, "parse_failures": pl.Int64, "rounds": pl.Int64, "byes": pl.Int64,
    "survivors": pl.Int64,
}
VOTES: dict[str, Any] = {
    "seed": pl.Int64, "problem_id": pl.String, "candidate_id": pl.String, "vote": pl.Int64,
    "verdict": pl.Boolean, "text": pl.String,
}
GAMES: dict[str, Any] = {
    "seed": pl.Int64, "problem_id": pl.String, "round": pl.Int64, "first_id": pl.String,
    "second_id": pl.String, "choice": pl.Int64, "winner_id": pl.String, "text": pl.String,
}


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    method: Literal["judge", "genselect", "hybrid"] = Field(
        ..., description="judge: pointwise votes on every candidate; genselect: knockout to one; "
                         "hybrid: knockout to winner_count, then the judge on the survivors")
    candidates: str = Field("candidates", description="paths key of the candidates folder")
    backend: BackendConfig = Field(..., description="the verifier: `model` is a paths key "
                                   "(local fine-tuned folder) or a served model name")
    prompt_style: pv.PromptStyle = Field("compact", description="compact (tiny models) or opc "
                                         "(the paper's tagged contract, for served models)")
    seeds: list[int] = Field([0, 1, 2], min_length=1, description="selection seeds")
    n_j: int = Field(8, ge=1, le=1024, description="judge verdicts per solution (paper: 32)")
    winner_count: int = Field(1, ge=1, le=4096, description="knockout survivors: 1 for "
                              "genselect; n_s for hybrid (paper: 16 of 256)")
    temperature: float = Field(1.0, ge=0, le=10, description="verifier sampling temperature "
                               "(paper: 0.6-1.0, the generator's setting)")
    max_new_tokens: int = Field(8, ge=1, le=131072, description="verifier reply budget")
    votes: str | None = Field(None, description="hybrid: paths key of the judge stage output "
                              "whose cached verdicts score the survivors")
    survivor_score: pv.SurvivorScore = Field(
        "all", description="hybrid: how a survivor's n_j cached verdicts score it. all: mean over "
                           "all n_j of 1[Yes], unparseable = not Yes (the paper's rule); "
                           "parseable: #Yes / #parseable, -1 if none parses (the lenient "
                           "ablation, stage hybrid_lenient)")
    max_problems: int | None = Field(None, ge=1, description="first k test problems only")
    num_threads: int = Field(0, ge=0, le=512, description="torch CPU threads (0: default)")
    out: str = Field(..., description="paths key of the output folder")

    @model_validator(mode="after")
    def _check(self) -> "Config":
        if self.method == "hybrid" and not self.votes:
            raise ValueError("method = hybrid needs `votes`: the paths key of the judge stage "
                             "output (its cached verdicts score the survivors)")
        if self.method != "hybrid" and self.survivor_score != "all":
            raise ValueError(f"survivor_score = {self.survivor_score!r} with method = "
                             f"{self.method}: it scores hybrid survivors only (the pure judge's "
                             "score is always #Yes / #parseable)")
        if self.method == "genselect" and self.winner_count != 1:
            raise ValueError(f"method = genselect: winner_count = {self.winner_count}, expected 1 "
                             "(pure GenSelect plays down to one winner; use hybrid for n_s > 1)")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds {self.seeds} repeat a value")
        return self


def resolve_backend(cfg: BackendConfig, ctx: Any) -> BackendConfig:
    """A local backend's `model` may name a declared path (e.g. `judge_model`)."""
    if cfg.kind == "local" and cfg.model in ctx.paths:
        return cfg.model_copy(update={"model": str(ctx.path(cfg.model))})
    return cfg


def check_verifier(cfg: BackendConfig, ctx: Any) -> None:
    """Fail early when a local verifier folder is a `train: false` placeholder."""
    if cfg.kind == "local" and cfg.model in ctx.paths:
        folder = ctx.path(cfg.model)
        if (folder / "PROMPTED.json").is_file():
            raise ValueError(f"backend.model = {cfg.model!r}: {folder} holds no model "
                             "(train_judge.train = false); point backend at a served model "
                             "(kind: openai) or train the verifier")


# --- judge ------------------------------------------------------------------------------------

def judge_votes(backend: Any, cands: pl.DataFrame, cfg: Config, seed: int) -> pl.DataFrame:
    """n_j verdicts for every candidate (one batched backend call), rows of VOTES."""
    prompts = [pv.judge_prompt(p, c, cfg.prompt_style)
               for p, c in zip(cands["prompt"], cands["completion"])]
    outs = backend.complete(prompts, max_new_tokens=cfg.max_new_tokens,
                            temperature=cfg.temperature, n=cfg.n_j, seed=seed)
    rows = []
    for pid, cid, replies in zip(cands["problem_id"], cands["candidate_id"], outs, strict=True):
        for j, r in enumerate(replies):
            rows.append({"seed": seed, "problem_id": pid, "candidate_id": cid, "vote": j,
                         "verdict": pv.parse_judgement(r.text), "text": r.text})
    return pl.DataFrame(rows, schema=VOTES)


def scores_from_votes(votes: pl.DataFrame, n_j: int,
                      score: Callable[[Sequence[bool | None]], float] = pv.judge_score
                      ) -> dict[str, float]:
    """candidate_id -> `score` of its first n_j verdicts (default: the judge's s(p))."""
    got: dict[str, list[bool | None]] = {}
    for cid, vote, verdict in zip(votes["candidate_id"], votes["vote"], votes["verdict"]):
        if vote < n_j:
            got.setdefault(cid, []).append(verdict)
    return {cid: score(v) for cid, v in got.items()}


# --- knockout ---------------------------------------------------------------------------------

def run_knockouts(backend: Any, problems: list[pl.DataFrame], cfg: Config, winner_count: int,
                  seed: int) -> tuple[list[pv.Knockout], list[dict[str, Any]]]:
    """One knockout per problem, all problems' games of a round in one backend call."""
    tournaments = []
    for k, g in enumerate(problems):
        invalid = [i for i, c in enumerate(g["completion"]) if not c.strip()]
        tournaments.append(pv.Knockout(g.height, winner_count,
                                       random.Random(f"knockout:{seed}:{k}"), invalid=invalid))
    texts: dict[tuple[int, int, int, int], str] = {}
    round_no = [0]

    def play(batch: list[pv.Game]) -> list[int | None]:
        prompts = []
        for t, a, b in batch:
            g = problems[t]
            prompts.append(pv.genselect_prompt(g["prompt"][0], g["completion"][a],
                                               g["completion"][b], cfg.prompt_style))
        outs = backend.complete(prompts, max_new_tokens=cfg.max_new_tokens,
                                temperature=cfg.temperature, n=1,
                                seed=seed * 10_000 + round_no[0])
        for (t, a, b), o in zip(batch, outs):
            texts[(t, tournaments[t].rounds - 1, a, b)] = o[0].text
        round_no[0] += 1
        return [pv.parse_choice(o[0].text, 2) for o in outs]

    pv.play_knockouts(tournaments, play)
    games = []
    for t, (g, ko) in enumerate(zip(problems, tournaments)):
        ids = g["candidate_id"].to_list()
        for rnd, a, b, choice, winner in ko.history:
            games.append({"seed": seed, "problem_id": g["problem_id"][0], "round": rnd,
                          "first_id": ids[a], "second_id": ids[b], "choice": choice,
                          "winner_id": ids[winner], "text": texts[(t, rnd, a, b)]})
    return tournaments, games


# --- the stage --------------------------------------------------------------------------------

def run(cfg: Config, ctx: Any) -> dict[str, float]:
    from stages.core.checks import read_parquet_checked
    from stages.models.base import set_threads
    from stages.proofverify.candidates import expectations

    cands = read_parquet_checked(ctx.path(cfg.candidates) / "test.parquet",
                                 expectations("test")).sort(["problem_id", "index"])
    pids = cands["problem_id"].unique(maintain_order=True).to_list()
    if cfg.max_problems:
        pids = pids[:cfg.max_problems]
        cands = cands.filter(pl.col("problem_id").is_in(pids))
    problems = [cands.filter(pl.col("problem_id") == p) for p in pids]
    n_p = max(g.height for g in problems)
    cached = None
    if cfg.method == "hybrid":
        assert cfg.votes is not None
        path = ctx.path(cfg.votes) / "votes.parquet"
        cached = read_parquet_checked(path, _votes_spec())
        have = int(cached["vote"].max()) + 1
        if have < cfg.n_j:
            raise ValueError(f"hybrid.n_j = {cfg.n_j}: the judge stage cached only {have} "
                             f"verdicts per solution in {path}; lower n_j or raise judge.n_j")
        missing = set(cfg.seeds) - set(cached["seed"].unique().to_list())
        if missing:
            raise ValueError(f"hybrid.seeds: {sorted(missing)} not among the judge stage's seeds "
                             f"({sorted(cached['seed'].unique().to_list())})")
    if cfg.method != "judge" and cfg.winner_count >= n_p:
        raise ValueError(f"{cfg.method}.winner_count = {cfg.winner_count}: must be below n_p = "
                         f"{n_p} candidates per problem")
    check_verifier(cfg.backend, ctx)
    set_threads(cfg.num_threads)
    backend = make_backend(resolve_backend(cfg.backend, ctx), root=ctx.root)

    selections, all_votes, all_games = [], [], []
    seconds = 0.0
    for seed in cfg.seeds:
        started = time.perf_counter()
        if cfg.method == "judge":
            votes = judge_votes(backend, cands, cfg, seed)
            all_votes.append(votes)
            scores = scores_from_votes(votes, cfg.n_j)
            for k, g in enumerate(problems):
                ids = g["candidate_id"].to_list()
                pick = pv.select_by_score(range(len(ids)), [scores[c] for c in ids],
                                          random.Random(f"ties:{seed}:{k}"))
                fails = votes.filter(pl.col("problem_id") == g["problem_id"][0])["verdict"] \
                    .null_count()
                selections.append(_row(cfg.method, seed, g, ids[pick], games=0,
                                       judgements=len(ids) * cfg.n_j, fails=fails,
                                       rounds=0, byes=0, survivors=len(ids)))
        else:
            w = cfg.winner_count
            tournaments, games = run_knockouts(backend, problems, cfg, w, seed)
            all_games += games
            scores = {}
            if cached is not None:
                scores = scores_from_votes(cached.filter(pl.col("seed") == seed), cfg.n_j,
                                           pv.survivor_score(cfg.survivor_score))
            for k, (g, ko) in enumerate(zip(problems, tournaments)):
                ids = g["candidate_id"].to_list()
                survivors = ko.winners
                judgements, fails = 0, ko.parse_failures
                if cfg.method == "hybrid":
                    pick = pv.select_by_score(survivors, [scores.get(c, -1.0) for c in ids],
                                              random.Random(f"ties:{seed}:{k}"))
                    judgements = len(survivors) * cfg.n_j
                    kept = {ids[i] for i in survivors}
                    fails += int(cached.filter((pl.col("seed") == seed)
                                               & pl.col("candidate_id").is_in(list(kept))
                                               & (pl.col("vote") < cfg.n_j))["verdict"]
                                 .null_count())
                else:
                    pick = survivors[0]
                selections.append(_row(cfg.method, seed, g, ids[pick], games=ko.calls,
                                       judgements=judgements, fails=fails, rounds=ko.rounds,
                                       byes=ko.byes, survivors=len(survivors)))
        seconds += time.perf_counter() - started
    sel = pl.DataFrame(selections, schema=SELECTIONS)
    with io.atomic_path(ctx.path(cfg.out), is_dir=True) as tmp:
        io.write_parquet(tmp / "selections.parquet", sel)
        if all_votes:
            io.write_parquet(tmp / "votes.parquet", pl.concat(all_votes))
        if all_games:
            io.write_parquet(tmp / "games.parquet", pl.DataFrame(all_games, schema=GAMES))
    ctx.log_metrics({"seconds_per_problem": seconds / (len(cfg.seeds) * len(problems))})
    m = summary(sel, cands)
    annotate_verifier(ctx, cfg.backend, m)
    return m


def annotate_verifier(ctx: Any, backend: BackendConfig, m: dict[str, float]) -> None:
    """Tag the registered version of the local verifier this rule called (train_judge's
    `verifier.json` names it) with the rule's scores, `metric.<stage>/proof_acc` etc.: the judge
    carries pure Judge's, the selector GenSelect's and Hybrid's."""
    if ctx.tracker is None or backend.kind != "local" or backend.model not in ctx.paths:
        return
    folder = ctx.path(backend.model)
    info = folder / "verifier.json"
    if info.is_file() and read_json_checked(info).get("registered_as"):
        ctx.tracker.annotate_model(folder, {f"{ctx.stage}/{k}": v for k, v in m.items()})


def _votes_spec() -> Any:
    from stages.core.checks import spec_from_schema

    from dataclasses import replace

    spec = spec_from_schema(VOTES, vote={"min": 0})
    # None = unparseable; a nullable Boolean reaches pandas as object: polars dtype only
    spec.columns["verdict"] = replace(spec.columns["verdict"], dtype=None, nullable=True)
    return spec


def _row(method: str, seed: int, g: pl.DataFrame, selected: str, *, games: int,
         judgements: int, fails: int, rounds: int, byes: int, survivors: int) -> dict[str, Any]:
    return {"method": method, "seed": seed, "problem_id": g["problem_id"][0],
            "selected_id": selected, "calls": games + judgements, "games": games,
            "judgements": judgements, "parse_failures": fails, "rounds": rounds, "byes": byes,
            "survivors": survivors}


def summary(sel: pl.DataFrame, cands: pl.DataFrame) -> dict[str, float]:
    """Stage metrics: accuracies and calls, mean over seeds (the compare stage adds the std);
    the wall time per problem goes to MLflow only."""
    joined = sel.join(cands.select(pl.col("candidate_id").alias("selected_id"), "valid",
                                   "answer_correct"), on="selected_id", how="left")
    per_seed = joined.group_by("seed").agg(pl.col("valid").mean(),
                                           pl.col("answer_correct").mean()).sort("seed")
    calls = float(sel["calls"].mean())
    return {"proof_acc": float(per_seed["valid"].mean()),
            "answer_acc": float(per_seed["answer_correct"].mean()),
            "calls_per_problem": calls,
            "parse_fail_rate": float(sel["parse_failures"].sum() / max(1, sel["calls"].sum()))}


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: the rule's proof-level and final-answer accuracy and verifier calls per
    problem (the same names for every rule: one row each in `dvc metrics show`); the parse
    failure rate in details/<rule>.json."""
    return {k: metrics[k] for k in ("proof_acc", "answer_acc", "calls_per_problem")
            if k in metrics}
