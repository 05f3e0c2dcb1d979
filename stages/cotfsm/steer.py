"""Sampling chains of thought from the tiny model, with steering at sentence ends, and stage
`steer_eval` of CoT-FSM: the four arms on a budget grid, every token charged to the ledger.

Steering is activation addition at ONE layer and ONE position, the sentence-final token
(`.`/`?`/`!`), through the forward hooks of `stages.models.hooks` inside `model.generate`: the
edit sees the residual stream h of that token, decodes the current state and the next-state
distribution with the linear probes, and adds alpha * v (orthogonal to h) there only; decoding
then continues from the steered cache (spec §6: not at later tokens). Arms (spec §3):

    default   no steering
    greedy    every sentence end: v = v_{q -> argmax_j R(q, j)}, alpha = `alpha_greedy` (1.0)
    weighted  every sentence end: v = sum_j R(q, j) v_{q->j} / sum |R(q, j)|, alpha_weighted
    qvalue    the gated online rule (`fsm.q_value_action`): only when the model is unsure or
              stuck AND the planned transition beats the model's likely one by delta

Budget grid: each arm runs at every `budgets` value of `nfe` (new tokens a problem may decode;
one forward pass per token, prefill included, as the ledger counts autoregressive decoding), a
trace that has not closed by then is wrong. Sampling uses the same generator seed for every arm
at a (seed, budget), so arms differ only where steering changed a trace (paired per problem).

    python -m stages cotfsm steer_eval
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from stages.cotfsm import fsm
from stages.cotfsm.traces import SENTENCE_END, parse_states
from stages.core import io

ARMS = ("default", "greedy", "weighted", "qvalue")


class Steering(BaseModel):
    """The online rule's settings (paper values [secondary] in params.yaml)."""

    model_config = ConfigDict(extra="forbid")

    conf_gate: float = Field(0.9, ge=0, le=1, description="no intervention when max g_next >= "
                                                          "this and not stuck")
    delta: float = Field(0.06, ge=0, description="least Q gap worth an intervention")
    beta: float = Field(0.3, ge=0, le=10, description="least alpha of Q-value steering "
                                                      "(paper: 0.1-1.2)")
    stuck_window: int = Field(5, ge=2, le=64, description="same state this many sentences: stuck")
    alpha_greedy: float = Field(1.0, ge=0, le=10, description="greedy steering strength")
    alpha_weighted: float = Field(0.5, ge=0, le=10, description="weighted steering strength "
                                                                "(paper: 0.1-1.0)")
    orthogonal: bool = Field(True, description="add v orthogonal to the current h (every arm)")


class Probes:
    """What `fit_fsm` fitted for one model: R, Q, the layer, the probes and vectors (torch)."""

    def __init__(self, arrays: dict[str, np.ndarray], layer: int):
        import torch

        self.layer = layer
        self.r, self.q = arrays["R"], arrays["Q"]
        t = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in arrays.items()}
        self.mean, self.scale = t["mean"], t["scale"]
        self.curr_w, self.curr_b = t["curr_w"], t["curr_b"]
        self.next_w, self.next_b = t["next_w"], t["next_b"]
        self.vectors = t["vectors"]                                   # (6, 6, d)

    def decode(self, h: Any) -> tuple[Any, Any]:
        """h (k, d) -> current states (k,) and next-state probabilities (k, 6)."""
        z = (h.float() - self.mean) / self.scale
        curr = (z @ self.curr_w.T + self.curr_b).argmax(dim=-1)
        nxt = (z @ self.next_w.T + self.next_b).softmax(dim=-1)
        return curr, nxt


class SentenceEndSteering:
    """A `hooks.steer` edit: at each sentence-final token, decide per the arm and add
    alpha * v there. Keeps per-row state history, interventions and probe reads."""

    def __init__(self, arm: str, probes: Probes, cfg: Steering, end_ids: Sequence[int],
                 batch: int):
        import torch

        if arm not in ARMS or arm == "default":
            raise ValueError(f"arm {arm!r}: expected one of {ARMS[1:]} to steer")
        self.arm, self.p, self.cfg = arm, probes, cfg
        self.end_ids = torch.tensor(sorted(end_ids))
        self.history: list[list[int]] = [[] for _ in range(batch)]
        self.interventions = np.zeros(batch, dtype=np.int64)
        self.reads = np.zeros(batch, dtype=np.int64)

    def direction(self, row: int, current: int, next_probs: np.ndarray) -> tuple[Any, float]:
        """(v, alpha) for one sentence end, or (None, 0) for none."""
        hist = self.history[row]
        if self.arm == "greedy":
            target = fsm.greedy_target(self.p.r, current)
            return self.p.vectors[current, target], self.cfg.alpha_greedy
        if self.arm == "weighted":
            import torch

            v = fsm.weighted_mixture(self.p.r, self.p.vectors.numpy(), current)
            return torch.as_tensor(v, dtype=torch.float32), self.cfg.alpha_weighted
        w = self.cfg.stuck_window
        stuck = len(hist) >= w and len(set(hist[-w:])) == 1
        act = fsm.q_value_action(self.p.q, current, next_probs, stuck,
                                 conf_gate=self.cfg.conf_gate, delta=self.cfg.delta,
                                 beta=self.cfg.beta)
        if act is None:
            return None, 0.0
        return self.p.vectors[current, act[0]], act[1]

    def __call__(self, hidden: Any, site: Any) -> Any:
        import torch

        if site.input_ids is None:
            raise ValueError("sentence-end steering needs input_ids")
        mask = torch.isin(site.input_ids, self.end_ids.to(site.input_ids.device))
        if not mask.any():
            return None
        rows, cols = mask.nonzero(as_tuple=True)
        h = hidden[rows, cols]                                          # (k, d)
        curr, nxt = self.p.decode(h)
        add = torch.zeros_like(h)
        for i, (b, q) in enumerate(zip(rows.tolist(), curr.tolist())):
            self.reads[b] += 1
            v, alpha = self.direction(b, q, nxt[i].numpy())
            self.history[b].append(q)
            if v is None or alpha == 0 or not torch.any(v != 0):
                continue
            v = v.to(h.dtype)
            if self.cfg.orthogonal:                     # spec §6: against the CURRENT h
                h_hat = h[i] / (h[i].norm() + 1e-6)
                v = v - (v @ h_hat) * h_hat
            add[i] = alpha * v
            self.interventions[b] += 1
        out = hidden.clone()
        out[rows, cols] = h + add
        return out


def sample_cots(model: Any, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int,
                seed: int, *, arm: str = "default", probes: Probes | None = None,
                steering: Steering | None = None, batch_size: int = 256) -> dict[str, Any]:
    """Sample one CoT per prompt. Returns per prompt: `words` (new tokens), `nfe` (tokens
    decoded, <= max_new_tokens), `input_tokens`, `interventions`, `reads` (probe reads), and
    `sequences` (prompt + CoT ids, unpadded, for reading hidden states)."""
    import torch

    from stages.models.hooks import steer

    end_ids = tokenizer.convert_tokens_to_ids(list(SENTENCE_END))
    out: dict[str, list] = {k: [] for k in ("words", "nfe", "input_tokens", "interventions",
                                            "reads", "sequences")}
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start:start + batch_size])
        batch = tokenizer(chunk, return_tensors="pt", padding=True)
        torch.manual_seed(seed * 100003 + start)        # the same stream for every arm
        edit = None
        if arm != "default":
            if probes is None or steering is None:
                raise ValueError(f"arm {arm!r} needs the fitted probes and steering settings")
            edit = SentenceEndSteering(arm, probes, steering, end_ids, len(chunk))
        kwargs = dict(do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                      max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                      eos_token_id=tokenizer.eos_token_id)
        with torch.no_grad():
            if edit is None:
                seqs = model.generate(**batch, **kwargs)
            else:
                with steer(model, probes.layer, edit):
                    seqs = model.generate(**batch, **kwargs)
        width = batch["input_ids"].shape[1]
        for i in range(len(chunk)):
            new = seqs[i, width:].tolist()
            n = next((j + 1 for j, t in enumerate(new) if t == tokenizer.eos_token_id), len(new))
            out["words"].append(tokenizer.convert_ids_to_tokens(new[:n]))
            out["nfe"].append(n)
            prompt_ids = batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist()
            out["input_tokens"].append(len(prompt_ids))
            out["sequences"].append(prompt_ids + new[:n])
            out["interventions"].append(int(edit.interventions[i]) if edit else 0)
            out["reads"].append(int(edit.reads[i]) if edit else 0)
    return out


def score(words: Sequence[str], difficulty: float, weights: np.ndarray, bias: float
          ) -> tuple[bool, list[int], bool]:
    """(correct, exact states, closed): closed traces succeed iff u < P(success | states)."""
    states, closed = parse_states(list(words))
    ok = closed and difficulty < fsm.success_probability(states, weights, bias)
    return ok, states, closed


# --- stage steer_eval ---------------------------------------------------------------------------

class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    arms: list[Literal["default", "greedy", "weighted", "qvalue"]] = Field(
        list(ARMS), min_length=2, description="arms; default is the baseline")
    budgets: list[int] = Field([48, 96, 160], min_length=1,
                               description="nfe budgets per problem (new tokens)")
    steering: Steering = Field(default_factory=Steering)
    n_test: int | None = Field(None, ge=2, description="test problems (None: the whole split)")
    batch_size: int = Field(256, ge=1, description="prompts per generate call")
    traces: str = Field("cotfsm_traces", description="paths key of the traces folder")
    models: str = Field("cotfsm_models", description="paths key of the models folder")
    fits: str = Field("cotfsm_fits", description="paths key of fit_fsm's folder")
    out: str = Field("cotfsm_results", description="paths key of the results folder")
    plot: str = Field("plots/cotfsm_curve.csv", description="plot CSV, relative to the pipeline")
    num_threads: int = Field(0, ge=0, le=256, description="torch CPU threads (0: all cores)")

    @field_validator("budgets")
    @classmethod
    def _budgets(cls, v: list[int]) -> list[int]:
        if any(b < 1 for b in v) or len(set(v)) != len(v):
            raise ValueError(f"budgets = {v}: expected distinct integers >= 1")
        return sorted(v)

    @field_validator("arms")
    @classmethod
    def _arms(cls, v: list[str]) -> list[str]:
        if "default" not in v or len(set(v)) != len(v):
            raise ValueError(f"arms = {v}: expected distinct arms including 'default'")
        return v


def load_probes(folder: Path) -> Probes:
    from safetensors.numpy import load_file

    from stages.core.checks import read_json_checked

    meta = read_json_checked(folder / "fsm.json", {"layer": int})
    arrays = load_file(str(folder / "fsm.safetensors"))
    need = {"R", "Q", "mean", "scale", "curr_w", "curr_b", "next_w", "next_b", "vectors"}
    if need - set(arrays):
        raise ValueError(f"{folder}/fsm.safetensors: missing arrays {sorted(need - set(arrays))}")
    return Probes(arrays, meta["layer"])


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import polars as pl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.cotfsm.traces import read_split, read_task
    from stages.models.base import set_threads
    from stages.search.budget import compute_curve, plot_accuracy_vs_compute, run_budget_grid
    from stages.search.ledger import Cost, Ledger

    set_threads(cfg.num_threads)
    test = read_split(ctx.path(cfg.traces), "test")
    weights, bias, _ = read_task(ctx.path(cfg.traces))
    if cfg.n_test:
        test = test.head(cfg.n_test)
    problems, prompts = test["id"].to_list(), test["prompt"].to_list()
    difficulty = test["difficulty"].to_list()
    fits = ctx.path(cfg.fits)
    seeds = sorted(int(d.name[4:]) for d in fits.iterdir() if d.name.startswith("seed"))
    if not seeds:
        raise FileNotFoundError(f"{fits}: no seed<k>/ folders; run fit_fsm first")
    rows: list[dict[str, Any]] = []
    grid_rows: list[dict[str, Any]] = []
    ledgers = {}
    for seed in seeds:
        probes = load_probes(fits / f"seed{seed}")
        mdir = ctx.path(cfg.models) / f"seed{seed}"
        tokenizer = AutoTokenizer.from_pretrained(str(mdir), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(str(mdir), local_files_only=True).eval()
        ledger = ledgers[seed] = Ledger()
        for arm in cfg.arms:
            def run_arm(budget: Any, meters: Any, arm: str = arm) -> dict[str, float]:
                got = sample_cots(model, tokenizer, prompts, budget.limit, seed=seed * 7919
                                  + budget.limit, arm=arm, probes=probes,
                                  steering=cfg.steering, batch_size=cfg.batch_size)
                scores = {}
                for i, p in enumerate(problems):
                    meters[p].charge(Cost(nfe=got["nfe"][i], generations=1,
                                          input_tokens=got["input_tokens"][i],
                                          output_tokens=got["nfe"][i],
                                          value_calls=got["reads"][i]))
                    ok, states, closed = score(got["words"][i], difficulty[i], weights, bias)
                    scores[p] = float(ok)
                    rows.append({"seed": seed, "arm": arm, "budget": budget.limit, "problem": p,
                                 "correct": ok, "closed": closed, "sentences": len(states),
                                 "interventions": got["interventions"][i],
                                 "probe_reads": got["reads"][i], "nfe": got["nfe"][i],
                                 "states": states})
                return scores

            grid = run_budget_grid(arm, run_arm, cfg.budgets, "nfe", problems, ledger)
            grid_rows += [r | {"seed": seed} for r in grid]
    frame = pl.DataFrame(rows)
    curve = compute_curve(grid_rows)
    metrics = summarize(frame, cfg.arms, cfg.budgets)
    log_method_runs(ctx, frame, cfg)
    with io.atomic_path(ctx.path(cfg.out), is_dir=True) as tmp:
        io.write_parquet(tmp / "results.parquet", frame)
        io.write_parquet(tmp / "curve.parquet", curve)
        plot_accuracy_vs_compute(curve, tmp / "acc_vs_nfe.png", x="nfe",
                                 title="CoT-FSM arms: accuracy vs decoded tokens (mean)")
    plot = ctx.pipeline_dir / cfg.plot
    plot.parent.mkdir(parents=True, exist_ok=True)
    with io.atomic_path(plot) as tmp:
        curve.select("arm", "budget", "nfe", "accuracy").write_csv(tmp)
    for seed, ledger in ledgers.items():
        for (arm, budget), secs in ledger.wall_seconds.items():
            metrics[f"{arm}/B{budget.limit}/seed{seed}/wall_seconds"] = secs
    return metrics


def summarize(frame: Any, arms: Sequence[str], budgets: Sequence[int]) -> dict[str, float]:
    """Per arm and budget: accuracy mean/std over seeds, interventions, nfe per problem."""
    import polars as pl

    from stages.core.stats import mean_std

    m: dict[str, float] = {}
    per_seed = (frame.group_by(["arm", "budget", "seed"])
                .agg(pl.col("correct").mean().alias("acc"),
                     pl.col("interventions").mean().alias("interventions"),
                     pl.col("nfe").mean().alias("nfe"), pl.col("closed").mean().alias("closed"))
                .sort(["arm", "budget", "seed"]))  # polars' group order varies run to run
    for arm in arms:
        for b in budgets:
            part = per_seed.filter((pl.col("arm") == arm) & (pl.col("budget") == b))
            for col in ("acc", "interventions", "nfe", "closed"):
                mean, std = mean_std(part[col].to_list())
                m[f"{arm}/B{b}/{col}_mean"] = mean
                if col == "acc":
                    m[f"{arm}/B{b}/acc_std"] = std
    return m


def log_method_runs(ctx: Any, frame: Any, cfg: Config) -> None:
    """One MLflow run per (arm, seed): params arm, seed and the steering settings; metrics
    `B<b>/acc`, `B<b>/interventions`, `B<b>/nfe` for every budget (the same set for every arm)."""
    import polars as pl

    for arm in cfg.arms:
        for seed in sorted(set(frame["seed"].to_list())):
            part = frame.filter((pl.col("arm") == arm) & (pl.col("seed") == seed))
            metrics = {}
            for b in cfg.budgets:
                g = part.filter(pl.col("budget") == b)
                metrics |= {f"B{b}/acc": float(g["correct"].mean()),
                            f"B{b}/interventions": float(g["interventions"].mean()),
                            f"B{b}/nfe": float(g["nfe"].mean())}
            params = {"arm": arm, "seed": seed, "budgets": ",".join(map(str, cfg.budgets)),
                      **({} if arm == "default" else cfg.steering.model_dump())}
            with ctx.method_run("steer_eval", arm, seed, params=params) as run:
                run.log_metrics(metrics)


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: accuracy per arm and interventions per problem of greedy and Q-value, at
    the largest budget (every arm, budget and the nfe in details/steer_eval.json)."""
    budgets = sorted({int(k.split("/")[1][1:]) for k in metrics if k.endswith("/acc_mean")})
    if not budgets:
        return {}
    b = budgets[-1]
    out = {f"acc_{arm}": metrics[f"{arm}/B{b}/acc_mean"] for arm in ARMS
           if f"{arm}/B{b}/acc_mean" in metrics}
    for arm in ("greedy", "qvalue"):
        if f"{arm}/B{b}/interventions_mean" in metrics:
            out[f"iv_{arm}"] = metrics[f"{arm}/B{b}/interventions_mean"]
    return out
