"""Stage `search` of DiffuReason: every arm on the test problems at every NFE budget, per seed.

The method (spec §2, reconstructed from the abstract and the lab's post; no paper text or code
is public): semi-autoregressive block decoding of a diffusion LM is cast as an MDP whose state
is (prompt, committed blocks b_1..b_k, masks elsewhere) and whose action is the fully denoised
next block (a *thought block*). Per committed block a UCT search (`stages.search.uct`, UCB1,
c_uct) repeats

    select   descend by Q(c) + c_uct sqrt(ln N(parent) / (1 + N(c)))
    expand   K children = K samples of the next block, ONE batched `fill` over every selected
             leaf of every problem (Gumbel-max sampling at `temperature` for diversity)
    simulate V(c) = self-consistency: M coarse completions of the whole masked suffix in
             `value_steps` forward passes each; V = (share of the M answers equal to their
             majority answer) * (mean confidence of c's block) ** conf_weight
    revise   if V(c) < tau_rev or min confidence of c's block < gamma (once per node): re-mask
             the lowest-confidence <= rho share of c's block, re-denoise it in place with the
             prefix AND the sketched suffix (a coarse completion that gave the majority answer)
             visible, re-value it (never reuse the old V: the suffix's conditionals changed);
             keep the revision when its value is higher
    backup   mean V of the new children along the path

then commits the root's most visited child. A terminal state (an `<eos>` committed, or the last
block) has no suffix: its V is its block's confidence times 1 if it holds a parsable answer,
else 0. The value reads only the state's tokens: the gold answer is never an input (tested).

Arms (all charged to one `stages.search.ledger.Ledger`, budget unit NFE = forward passes per
sequence; a batched pass over R rows costs R):

    vanilla        one greedy block decode; at budget b it takes min(B, b / n_blocks) steps
                   per block (more steps = fewer tokens committed per step; B is the ceiling)
    best_of_n      N = b / V vanilla decodes (the first greedy, the rest sampled), majority vote
    diffureason    the search above, with revision
    no_revise      the search without revision
    ar_mcts        the AR twin + the same UCT and the SAME value (the diffusion LM's coarse
                   rollouts; the AR model's token probabilities as block confidence); a child
                   is B sampled tokens, B NFE (KV cache: one pass per new token)

V = n_blocks * T_b, the vanilla cost at the spec's T_b = B/2; budgets are `multipliers` * V.
A search splits what is left over the blocks still to commit and keeps in reserve what a
greedy finish of the remaining blocks costs (T_b per block; B for the AR twin), so it never
ends without an answer for lack of budget; a problem whose budget cannot pay one simulation
for a block decodes that block greedily (at 1x every search arm IS vanilla decoding; the AR
twin, one pass per token, cannot even finish at 1x: it is scored on what it wrote). An
`<eos>` ends a response for every arm: the rest is `<eos>` at no cost.

Output: `results.parquet`, one row per (seed, arm, budget, problem) with `score`, `steps` (the
problem's difficulty) and every ledger unit; `values.parquet`, every non-terminal value of the
diffusion search with whether its majority answer was right (scored AFTER the search, for the
spec's check that the value correlates with correctness).

    python -m stages diffureason search
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field

from stages.core import io
from stages.search.ledger import Cost

ARMS = ("vanilla", "best_of_n", "diffureason", "no_revise", "ar_mcts")


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    arms: list[str] = Field(default_factory=lambda: list(ARMS), description="arms to run")
    multipliers: list[int] = Field(default_factory=lambda: [1, 4, 16],
                                   description="NFE budgets as multiples of vanilla [spec]")
    test_rows: int = Field(500, ge=1, description="test problems [spec: 500]")
    k: int = Field(4, ge=1, le=64, description="children per expansion K [spec: 4]")
    m: int = Field(4, ge=1, le=64, description="coarse completions per value M [spec: 4]")
    n_sim: int = Field(8, ge=1, description="most simulations per block [spec: 8]")
    c_uct: float = Field(1.2, ge=0, le=10, description="UCT exploration [spec: 1.0-1.4]")
    value_steps: int = Field(1, ge=1, le=8, description="passes per coarse completion "
                                                        "[spec: 1-4]")
    conf_weight: float = Field(1.0, ge=0, le=4, description="V *= block confidence ** w "
                                                            "[spec: optional; ours 1]")
    tau_rev: float = Field(0.5, ge=0, le=1, description="revise when V < tau_rev [spec: 0.5]")
    gamma: float = Field(0.3, ge=0, le=1, description="... or a token's confidence < gamma "
                                                      "[spec: 0.3]")
    rho: float = Field(0.25, gt=0, le=1, description="most share of a block re-masked "
                                                     "[spec: 25%]")
    revise_steps: int = Field(1, ge=1, le=8, description="passes to re-denoise [ours]")
    max_revisions: int = Field(1, ge=0, le=2, description="revisions per node [spec: 1-2]")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of children, "
                                                      "best-of-N and rollouts")
    batch_size: int = Field(512, ge=1, description="rows per forward pass")
    problems: str = Field("diffureason_problems", description="paths key of the problems")
    models: str = Field("diffureason_models", description="paths key of the models")
    out: str = Field("diffureason_search", description="paths key of the output")
    num_threads: int = Field(0, ge=0, le=256, description="torch threads (0: all cores); "
                                                          "fixed, so wall clock is comparable")


# --- the diffusion LM in the task layout ----------------------------------------------------

class Decoder:
    """The diffusion LM over fixed-length rows (`stages.models.mdlm` layout)."""

    def __init__(self, model: Any, tok: Any, meta: dict, seed: int = 0, batch_size: int = 512):
        import torch

        from stages.models.mdlm import banned_ids

        self.model, self.tok = model, tok
        self.P, self.L, self.B = meta["prompt_len"], meta["response_len"], meta["block_size"]
        self.n_blocks = self.L // self.B
        self.S = self.P + self.L
        self.mask, self.eos, self.pad = tok.mask_token_id, tok.eos_token_id, tok.pad_token_id
        self.banned = banned_ids(tok)
        self.gen = torch.Generator().manual_seed(seed)
        self.batch_size = batch_size

    def init_rows(self, prompts: Sequence[str]) -> tuple[Any, Any]:
        import torch

        from stages.models.mdlm import encode

        x = torch.tensor([encode(self.tok, p, None, self.P, self.L) for p in prompts],
                         dtype=torch.long)
        return x, torch.zeros(x.shape)

    def block_mask(self, ks: Sequence[int]) -> Any:
        import torch

        pos = torch.arange(self.S)[None, :]
        start = torch.tensor([self.P + k * self.B for k in ks])[:, None]
        return (pos >= start) & (pos < start + self.B)

    def suffix_mask(self, ks: Sequence[int]) -> Any:
        """Positions from block k on (everything not yet committed)."""
        import torch

        pos = torch.arange(self.S)[None, :]
        return pos >= torch.tensor([self.P + k * self.B for k in ks])[:, None]

    def fill(self, x: Any, conf: Any, allowed: Any, steps: int, temperature: float) -> Any:
        from stages.models.mdlm import fill

        return fill(self.model, x, conf, allowed, steps, mask_id=self.mask, pad_id=self.pad,
                    banned=self.banned, temperature=temperature, generator=self.gen,
                    batch_size=self.batch_size)

    def ended(self, x: Any) -> Any:
        """Rows with an `<eos>` committed in the response (the answer is over)."""
        return (x[:, self.P:] == self.eos).any(1)

    def close(self, x: Any) -> Any:
        """After the first committed `<eos>` everything is `<eos>` (free: nothing is run)."""
        import torch

        resp = x[:, self.P:]
        seen = (resp == self.eos).long().cummax(1).values.bool()
        resp = torch.where(seen & (resp == self.mask), torch.full_like(resp, self.eos), resp)
        out = x.clone()
        out[:, self.P:] = resp
        return out

    def vanilla(self, prompts: Sequence[str], steps: int, temperature: float = 0.0,
                x: Any = None) -> Any:
        """Block decoding of whole responses; returns x (see `vanilla_cost` for NFE)."""
        x, _ = self.vanilla_cost(prompts, steps, temperature, x)
        return x

    def vanilla_cost(self, prompts: Sequence[str], steps: int, temperature: float = 0.0,
                     x: Any = None) -> tuple[Any, list[int]]:
        """(x, NFE per row): block by block, `steps` passes each, rows stop at `<eos>`."""
        if x is None:
            x, conf = self.init_rows(prompts)
        else:
            import torch
            conf = torch.zeros(x.shape)
        nfe = [0] * len(x)
        for k in range(self.n_blocks):
            live = (~self.ended(x)).nonzero().flatten().tolist()
            if not live:
                break
            xs, cs = self.fill(x[live], conf[live], self.block_mask([k] * len(live)), steps,
                               temperature)
            x[live], conf[live] = xs, cs
            for i in live:
                nfe[i] += steps
        return self.close(x), nfe

    def response(self, row: Any) -> str:
        from stages.models.mdlm import decode_response

        return decode_response(self.tok, row, self.P)

    def answers(self, x: Any) -> list[int | None]:
        from stages.diffureason.task import extract_answer

        return [extract_answer(self.response(r)) if "_" not in self.response(r) else None
                for r in x]


def accuracy(dec: Decoder, x: Any, gold: Sequence[int]) -> float:
    got = dec.answers(x)
    return sum(a is not None and a == g for a, g in zip(got, gold)) / max(len(gold), 1)


class ARDecoder:
    """The AR twin writing into the same row layout (HF `generate`, KV cache)."""

    def __init__(self, model: Any, tok: Any, meta: dict, seed: int = 0, batch_size: int = 512):
        from stages.models.mdlm import banned_ids

        self.model, self.tok = model, tok
        self.P, self.L, self.B = meta["prompt_len"], meta["response_len"], meta["block_size"]
        self.S = self.P + self.L
        self.seed, self.calls = seed, 0
        self.batch_size = batch_size
        self.banned = banned_ids(tok)

    def extend(self, x: Any, ks: Sequence[int], n_tokens: int, temperature: float
               ) -> tuple[Any, Any]:
        """Write `n_tokens` tokens at block k of each row (sampled; greedy at temperature 0),
        `<eos>` after an `<eos>`; returns (x, conf) with conf = probability of each token."""
        import torch

        x = x.clone()
        conf = torch.zeros(x.shape)
        tok = self.tok
        for lo in range(0, len(x), self.batch_size):
            rows = x[lo:lo + self.batch_size]
            kk = ks[lo:lo + self.batch_size]
            seqs = []
            for r, k in zip(rows, kk):
                ids = r[:self.P + k * self.B].tolist()
                seqs.append([i for i in ids if i != tok.pad_token_id])
            width = max(len(s) for s in seqs)
            inp = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
            att = torch.zeros((len(seqs), width), dtype=torch.long)
            for i, s in enumerate(seqs):
                inp[i, width - len(s):] = torch.tensor(s)
                att[i, width - len(s):] = 1
            self.calls += 1
            torch.manual_seed(self.seed * 100_003 + self.calls)
            sample = temperature > 0
            out = self.model.generate(
                input_ids=inp, attention_mask=att, max_new_tokens=n_tokens,
                min_new_tokens=n_tokens, do_sample=sample,
                temperature=temperature if sample else None, top_k=0 if sample else None,
                top_p=None, suppress_tokens=self.banned, output_scores=True,
                return_dict_in_generate=True, pad_token_id=tok.pad_token_id,
                eos_token_id=None)
            new = out.sequences[:, width:]
            probs = torch.stack([torch.softmax(s.float(), -1) for s in out.scores], 1)
            p_new = probs.gather(-1, new[..., None])[..., 0]
            for i, k in enumerate(kk):
                start = self.P + k * self.B
                toks, ps = new[i].clone(), p_new[i]
                hit = (toks == tok.eos_token_id).long().cummax(0).values.bool()
                toks[hit] = tok.eos_token_id
                x[lo + i, start:start + n_tokens] = toks
                conf[lo + i, start:start + n_tokens] = ps
        return x, conf

    def greedy(self, prompts: Sequence[str]) -> Any:
        from stages.models.mdlm import encode
        import torch

        x = torch.tensor([encode(self.tok, p, None, self.P, self.L) for p in prompts])
        x, _ = self.extend(x, [0] * len(x), self.L, 0.0)
        return x


# --- the search model -----------------------------------------------------------------------

@dataclass(eq=False)
class State:
    pid: str
    x: Any            # the row: prompt, committed blocks, masks elsewhere
    conf: Any         # confidence of each committed token
    k: int            # blocks committed
    revisions: int = 0


class Searcher:
    """`stages.search.uct.SearchModel` over thought blocks, for the diffusion LM (`ar` None) or
    the AR twin (`ar` given: children from the AR model, values from the diffusion LM)."""

    def __init__(self, cfg: Config, dec: Decoder, revise: bool, ar: ARDecoder | None = None):
        self.cfg, self.dec, self.revise, self.ar = cfg, dec, revise and ar is None, ar
        self.t_b = max(1, dec.B // 2)
        self.reserve: dict[str, int] = {}
        self.value_log: list[tuple[str, float, int | None]] = []

    # cost of one step at a node, and of a greedy block
    def step_nfe(self) -> int:
        c = self.cfg
        child = self.dec.B if self.ar is not None else self.t_b
        nfe = c.k * child + c.k * c.m * c.value_steps
        if self.revise:
            nfe += c.k * (c.revise_steps + c.m * c.value_steps)
        return nfe

    def finish_nfe(self) -> int:
        return self.dec.B if self.ar is not None else self.t_b

    def bound(self, node: Any) -> Cost:
        return Cost(nfe=self.step_nfe() + self.reserve.get(node.state.pid, 0))

    def terminal(self, x: Any, k: int) -> bool:
        return bool(self.dec.ended(x[None])[0]) or k >= self.dec.n_blocks

    def expand(self, nodes: Sequence[Any]) -> list[Any]:
        import torch

        from stages.search.uct import Child, Expansion

        K, dec = self.cfg.k, self.dec
        x = torch.stack([n.state.x for n in nodes for _ in range(K)])
        conf = torch.stack([n.state.conf for n in nodes for _ in range(K)])
        ks = [n.state.k for n in nodes for _ in range(K)]
        if self.ar is None:
            x, new_conf = dec.fill(x, conf, dec.block_mask(ks), self.t_b, self.cfg.temperature)
            per = self.t_b
        else:
            x, bconf = self.ar.extend(x, ks, dec.B, self.cfg.temperature)
            new_conf = torch.where(dec.block_mask(ks), bconf, conf)
            per = dec.B
        x = dec.close(x)
        out = []
        for i, n in enumerate(nodes):
            kids = []
            for j in range(i * K, (i + 1) * K):
                st = State(n.state.pid, x[j], new_conf[j], n.state.k + 1)
                kids.append(Child(st, terminal=self.terminal(x[j], st.k)))
            out.append(Expansion(kids, Cost(nfe=K * per, generations=K,
                                            output_tokens=K * dec.B)))
        return out

    def values(self, states: Sequence[State], terminal: Sequence[bool]
               ) -> tuple[list[float], list[Any], list[int]]:
        """(V, sketch row, NFE) per state: module docstring."""
        import torch

        dec, M, c = self.dec, self.cfg.m, self.cfg
        vals: list[float] = [0.0] * len(states)
        sketch: list[Any] = [None] * len(states)
        nfe = [0] * len(states)
        bconf = [block_conf(dec, s)[0] ** c.conf_weight for s in states]
        open_ = [i for i, t in enumerate(terminal) if not t]
        for i, t in enumerate(terminal):
            if t:
                ok = dec.answers(states[i].x[None])[0] is not None
                vals[i], sketch[i] = (1.0 if ok else 0.0) * bconf[i], states[i].x
        if open_:
            x = torch.stack([states[i].x for i in open_ for _ in range(M)])
            conf = torch.stack([states[i].conf for i in open_ for _ in range(M)])
            ks = [states[i].k for i in open_ for _ in range(M)]
            x, _ = dec.fill(x, conf, dec.suffix_mask(ks), c.value_steps, c.temperature)
            x = dec.close(x)
            answers = dec.answers(x)
            for j, i in enumerate(open_):
                got = answers[j * M:(j + 1) * M]
                counts = Counter(a for a in got if a is not None)
                top, share = (counts.most_common(1)[0][0], counts.most_common(1)[0][1] / M) \
                    if counts else (None, 0.0)
                vals[i] = share * bconf[i]
                pick = next((r for r, a in enumerate(got) if a == top), 0)
                sketch[i] = x[j * M + pick]
                nfe[i] = M * c.value_steps
                self.value_log.append((states[i].pid, vals[i], top))
        return vals, sketch, nfe

    def evaluate(self, nodes: Sequence[Any]) -> list[Any]:
        import torch

        from stages.search.uct import Evaluation

        c, dec = self.cfg, self.dec
        states = [n.state for n in nodes]
        vals, sketch, nfe = self.values(states, [n.terminal for n in nodes])
        calls = [1] * len(nodes)
        if self.revise and c.max_revisions > 0:
            todo = []
            for i, s in enumerate(states):
                low = block_conf(dec, s)[1]
                if s.revisions < c.max_revisions and (vals[i] < c.tau_rev or low < c.gamma):
                    todo.append(i)
            if todo:
                xs, cs, ks = [], [], []
                for i in todo:
                    s = states[i]
                    blk = dec.block_mask([s.k - 1])[0] & (s.conf > 0)
                    idx = blk.nonzero().flatten()
                    n_re = max(1, min(int(c.rho * dec.B), int((s.conf[idx] < c.gamma).sum())))
                    worst = idx[s.conf[idx].argsort()[:n_re]]
                    x = sketch[i].clone()
                    x[worst] = dec.mask
                    xs.append(x)
                    cs.append(s.conf.clone())
                    ks.append(s.k)
                x = torch.stack(xs)
                allowed = x == dec.mask
                x, conf = dec.fill(x, torch.stack(cs), allowed, c.revise_steps, 0.0)
                # keep the revised block; the sketched suffix is masked again
                keep = ~dec.suffix_mask(ks)
                x = torch.where(keep, x, torch.full_like(x, dec.mask))
                x = dec.close(x)
                new = [State(states[i].pid, x[j], conf[j], ks[j], states[i].revisions + 1)
                       for j, i in enumerate(todo)]
                term = [self.terminal(s.x, s.k) for s in new]
                v2, _, nfe2 = self.values(new, term)
                for j, i in enumerate(todo):
                    nfe[i] += c.revise_steps + nfe2[j]
                    calls[i] += 1
                    # a revision that ends or un-ends the answer is dropped (the node's terminal
                    # flag was set at expansion)
                    if v2[j] > vals[i] and term[j] == nodes[i].terminal:
                        nodes[i].state, vals[i] = new[j], v2[j]
                    else:
                        nodes[i].state.revisions += 1
        return [Evaluation(min(1.0, max(0.0, v)), Cost(nfe=n, value_calls=k))
                for v, n, k in zip(vals, nfe, calls)]


def block_conf(dec: Decoder, s: State) -> tuple[float, float]:
    """(mean, min) confidence of the tokens the model wrote in the state's last block; the
    `<eos>` that `close` put after an answer (confidence 0: nothing predicted it) is left out.
    (1, 1) when the model wrote none there."""
    if s.k == 0:
        return 1.0, 1.0
    blk = dec.block_mask([s.k - 1])[0] & (s.conf > 0)
    if not bool(blk.any()):
        return 1.0, 1.0
    vals = s.conf[blk]
    return float(vals.mean()), float(vals.min())


# --- arms -----------------------------------------------------------------------------------

def vanilla_cost(dec: Decoder) -> int:
    """V: NFE of vanilla decoding at T_b = B/2 (the unit of the budget grid)."""
    return dec.n_blocks * max(1, dec.B // 2)


def run_vanilla(dec: Decoder, prompts: dict[str, str], budget: int, meters: dict
                ) -> dict[str, Any]:
    steps = max(1, min(dec.B, budget // dec.n_blocks))
    pids = list(prompts)
    x, nfe = dec.vanilla_cost([prompts[p] for p in pids], steps)
    for i, p in enumerate(pids):
        meters[p].charge(Cost(nfe=nfe[i], generations=1, output_tokens=dec.L))
    return dict(zip(pids, x))


def run_best_of_n(dec: Decoder, prompts: dict[str, str], budget: int, meters: dict,
                  temperature: float) -> dict[str, int | None]:
    t_b = max(1, dec.B // 2)
    n = max(1, budget // vanilla_cost(dec))
    pids = list(prompts)
    x0, nfe0 = dec.vanilla_cost([prompts[p] for p in pids], t_b)          # sample 0: greedy
    answers = {p: [a] for p, a in zip(pids, dec.answers(x0))}
    spent = dict(zip(pids, nfe0))
    if n > 1:
        rep = [p for p in pids for _ in range(n - 1)]
        x, nfe = dec.vanilla_cost([prompts[p] for p in rep], t_b, temperature)
        for p, a, c in zip(rep, dec.answers(x), nfe):
            answers[p].append(a)
            spent[p] += c
    out = {}
    for p in pids:
        meters[p].charge(Cost(nfe=spent[p], generations=n, output_tokens=n * dec.L))
        counts = Counter(a for a in answers[p] if a is not None)
        # majority; ties go to the answer seen first (the greedy sample first)
        best = max(counts.values()) if counts else 0
        out[p] = next((a for a in answers[p] if a is not None and counts[a] == best), None)
    return out


def run_tree(cfg: Config, searcher: Searcher, prompts: dict[str, str], meters: dict,
             seed: int) -> dict[str, Any]:
    """One UCT search per problem, all problems batched per round; block by block."""
    import torch

    from stages.search.uct import Search, SearchConfig, Tree

    dec = searcher.dec
    pids = list(prompts)
    x0, c0 = dec.init_rows([prompts[p] for p in pids])
    trees = {p: Tree(State(p, x0[i], c0[i], 0), meters[p], seed=seed * 7919 + i)
             for i, p in enumerate(pids)}
    engine = Search(SearchConfig(select="ucb1", c=cfg.c_uct, max_sims=cfg.n_sim), searcher)
    finish = searcher.finish_nfe()
    for _ in range(dec.n_blocks):
        live = [p for p in pids if not trees[p].root.terminal]
        if not live:
            break
        for p in live:
            left = dec.n_blocks - trees[p].root.state.k
            remaining = meters[p].remaining or 0
            spare = max(0, remaining - finish * left)
            searcher.reserve[p] = finish * (left - 1) + spare * (left - 1) // left
        engine.simulate([trees[p] for p in live])
        greedy = []
        for p in live:
            if trees[p].root.children:
                trees[p].commit()
            else:
                greedy.append(p)
        # a problem whose block could not pay a simulation decodes it greedily (the reserve
        # pays); grouped by what each can still pay (diffusion: passes, AR: tokens)
        groups: dict[int, list[str]] = {}
        for p in greedy:
            groups.setdefault(min(finish, meters[p].remaining or 0), []).append(p)
        for per, group in groups.items():
            if per <= 0:
                for p in group:
                    trees[p].root.terminal = True       # out of budget: scored as it stands
                continue
            states = [trees[p].root.state for p in group]
            x = torch.stack([s.x for s in states])
            conf = torch.stack([s.conf for s in states])
            ks = [s.k for s in states]
            if searcher.ar is None:
                x, conf = dec.fill(x, conf, dec.block_mask(ks), per, 0.0)
            else:
                x, bc = searcher.ar.extend(x, ks, per, 0.0)
                conf = torch.where(dec.block_mask(ks), bc, conf)
            x = dec.close(x)
            for j, p in enumerate(group):
                meters[p].charge(Cost(nfe=per, generations=1, output_tokens=dec.B))
                st = State(p, x[j], conf[j], ks[j] + 1)
                trees[p] = Tree(st, meters[p], seed=seed * 7919 + pids.index(p) + 1)
                # an AR block cut short by the budget ends the response (scored as it stands)
                trees[p].root.terminal = searcher.terminal(x[j], st.k) or (
                    searcher.ar is not None and per < finish)
    return {p: trees[p].root.state.x for p in pids}


def run_arm(arm: str, cfg: Config, dec: Decoder, ar: ARDecoder | None, prompts: dict[str, str],
            budget: int, meters: dict, seed: int, log: list | None = None
            ) -> dict[str, int | None]:
    if arm == "vanilla":
        xs = run_vanilla(dec, prompts, budget, meters)
    elif arm == "best_of_n":
        return run_best_of_n(dec, prompts, budget, meters, cfg.temperature)
    elif arm in ("diffureason", "no_revise", "ar_mcts"):
        searcher = Searcher(cfg, dec, revise=arm == "diffureason",
                            ar=ar if arm == "ar_mcts" else None)
        xs = run_tree(cfg, searcher, prompts, meters, seed)
        if log is not None:
            log.extend((arm, budget, *row) for row in searcher.value_log)
    else:
        raise ValueError(f"unknown arm {arm!r}; expected one of {ARMS}")
    pids = list(prompts)
    import torch

    return dict(zip(pids, dec.answers(torch.stack([xs[p] for p in pids]))))


def result_spec() -> Any:
    import polars as pl

    from stages.core.checks import spec_from_schema

    return spec_from_schema({"seed": pl.Int64, "arm": pl.String, "unit": pl.String,
                             "mult": pl.Int64,
                             "budget": pl.Int64, "problem": pl.String, "steps": pl.Int64,
                             "score": pl.Float64, "nfe": pl.Int64, "generations": pl.Int64},
                            score={"min": 0.0, "max": 1.0}, nfe={"min": 0})


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import polars as pl

    from stages.diffureason.task import read_problems
    from stages.models.base import set_threads
    from stages.models.generate import load_model
    from stages.models.mdlm import load_mdlm
    from stages.search.budget import compute_curve, run_budget_grid
    from stages.search.ledger import Ledger

    bad = sorted(set(cfg.arms) - set(ARMS))
    if bad:
        raise ValueError(f"search.arms: unknown {bad}; expected a subset of {list(ARMS)}")
    if len(set(cfg.multipliers)) != len(cfg.multipliers) or min(cfg.multipliers) < 1:
        raise ValueError(f"search.multipliers = {cfg.multipliers}: expected distinct ints >= 1")
    threads = set_threads(cfg.num_threads)
    df, meta = read_problems(ctx.path(cfg.problems))
    test = df.filter(pl.col("split") == "test").head(cfg.test_rows)
    prompts = dict(zip(test["id"].to_list(), test["prompt"].to_list()))
    gold = dict(zip(test["id"].to_list(), test["answer"].to_list()))
    steps = dict(zip(test["id"].to_list(), test["steps"].to_list()))
    models = ctx.path(cfg.models)
    seeds = sorted(int(p.name[4:]) for p in models.glob("seed*"))
    if not seeds:
        raise FileNotFoundError(f"{models}: no seed<k>/ folders; run stage train first")
    rows: list[dict[str, Any]] = []
    vlog: list[dict[str, Any]] = []
    wall: dict[tuple[str, int], float] = {}
    for seed in seeds:
        diff, tok = load_mdlm(models / f"seed{seed}" / "mdlm")
        ar_model, _ = load_model(models / f"seed{seed}" / "ar", device="cpu")
        dec = Decoder(diff, tok, meta, seed=seed, batch_size=cfg.batch_size)
        ar = ARDecoder(ar_model, tok, meta, seed=seed, batch_size=cfg.batch_size)
        V = vanilla_cost(dec)
        ledger = Ledger()
        for arm in cfg.arms:
            log: list = []

            def play(budget: Any, meters: Any, arm: str = arm, log: list = log
                     ) -> dict[str, float]:
                got = run_arm(arm, cfg, dec, ar, prompts, budget.limit, meters, seed, log)
                return {p: float(got[p] is not None and got[p] == gold[p]) for p in prompts}

            started = time.perf_counter()
            grid = run_budget_grid(arm, play, [m * V for m in cfg.multipliers], "nfe",
                                   list(prompts), ledger)
            wall[(arm, seed)] = time.perf_counter() - started
            for r in grid:
                rows.append({"seed": seed, "mult": r["budget"] // V, "steps": steps[r["problem"]],
                             **r})
            for a, b, pid, v, top in log:
                vlog.append({"seed": seed, "arm": a, "mult": b // V, "problem": pid,
                             "value": float(v), "majority_right": top is not None
                             and top == gold[pid]})
        curve = compute_curve([r for r in rows if r["seed"] == seed], ledger)
        for r in curve.iter_rows(named=True):
            ctx.log_metrics({f"wall_s/{r['arm']}/x{r['budget'] // V}/seed{seed}":
                             float(r["wall_seconds_per_problem"])})
    frame = pl.DataFrame(rows).select("seed", "arm", "unit", "mult", "budget", "problem",
                                      "steps", "score", "nfe", "generations", "input_tokens",
                                      "output_tokens", "value_calls")
    values = pl.DataFrame(vlog, schema={"seed": pl.Int64, "arm": pl.String, "mult": pl.Int64,
                                        "problem": pl.String, "value": pl.Float64,
                                        "majority_right": pl.Boolean})
    out = ctx.path(cfg.out)
    with io.atomic_path(out, is_dir=True) as tmp:
        io.write_parquet(tmp / "results.parquet", frame)
        io.write_parquet(tmp / "values.parquet", values)
    top = max(cfg.multipliers)
    metrics: dict[str, float] = {"vanilla_nfe": float(V), "threads": float(threads),
                                 "test_rows": float(len(prompts))}
    for (arm, seed), part in frame.group_by(["arm", "seed"], maintain_order=True):
        t = part.filter(pl.col("mult") == top)
        with ctx.method_run("search", str(arm), int(seed),
                            {"arm": arm, "seed": seed, "budget_mult": top}) as run_:
            run_.log_metrics({"accuracy": float(t["score"].mean()),
                              "nfe": float(t["nfe"].mean()),
                              "generations": float(t["generations"].mean()),
                              "wall_s_per_problem": wall[(arm, seed)] / len(prompts)
                              / len(cfg.multipliers)})
    for arm in cfg.arms:
        for mult in cfg.multipliers:
            part = frame.filter((pl.col("arm") == arm) & (pl.col("mult") == mult))
            metrics[f"{arm}/x{mult}/accuracy"] = float(part["score"].mean())
            metrics[f"{arm}/x{mult}/nfe"] = float(part["nfe"].mean())
    if len(values):
        metrics["value_auc"] = auc(values["value"].to_list(), values["majority_right"].to_list())
    return metrics


def auc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """P(score of a positive > score of a negative), ties half (NaN with one class only)."""
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    if not pos or not neg:
        return math.nan
    order = sorted([(s, 1) for s in pos] + [(s, 0) for s in neg])
    # rank-sum with average ranks for ties
    i = 0
    total_pos_rank = 0.0
    while i < len(order):
        j = i
        while j < len(order) and order[j][0] == order[i][0]:
            j += 1
        avg = (i + j + 1) / 2
        total_pos_rank += avg * sum(1 for t in order[i:j] if t[1] == 1)
        i = j
    n_pos, n_neg = len(pos), len(neg)
    return (total_pos_rank - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def headline(details: dict[str, float]) -> dict[str, float]:
    tops = sorted({int(k.split("/")[1][1:]) for k in details if k.startswith("vanilla/x")})
    if not tops:
        return {}
    t = tops[-1]
    names = {"vanilla": f"vanilla/x{t}/accuracy", "diffureason": f"diffureason/x{t}/accuracy",
             "value_auc": "value_auc"}
    return {k: details[v] for k, v in names.items() if v in details}
