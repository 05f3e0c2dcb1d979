"""HSIR: Harnessing Self-Improvement in Reasoning models (Zhong et al., "Better, Faster: Harnessing
Self-Improvement in Large Reasoning Models", arXiv 2605.24998, ICML 2026).

STaR-style self-improvement (train on your own correct samples) stalls on hard queries because
correct samples come mostly from easy ones, and because many kept samples overthink (repeat steps).
HSIR fixes both before each training round:

    VeriExit  a WRONG sample whose derivation passed through the gold answer is truncated at the
              first step whose result is gold, plus an exit cue -> a new, short correct sample
    InDiv     a correct sample is kept only if its steps are diverse in the model's own hidden
              space: InDiv(s) >= tau (near-duplicate steps -> low score -> dropped)
    H-GRPO    GRPO with reward R_i = 1[correct_i] + w * z_group(InDiv_i), bonus on correct only

What is solid and what is guessed:
- [secondary] the two components, the loop structure (K = 10 samples, VeriExit on wrong samples,
  InDiv filter with tau = -0.5 on the paper's scale), H-GRPO as "InDiv as an extra reward".
- [reconstructed] everything below the mechanism level: VeriExit's exact matching and cue, the
  InDiv formula (attention-weighted step embeddings, EigenScore-style log-determinant of their Gram
  matrix, or a normalised spectral entropy), the H-GRPO reward's form and w = 0.2. The InDiv score
  sits behind `INDIV_METHODS` so the paper's formula can be swapped in.

The small-scale task is `stages.tasks.arith` (" 23+45=68; 68-17=51 #### 51"): a step is one
equation, steps are separated by ";", the answer (and thus VeriExit's exit cue) follows "####".
Overthinking seed traces add RE-VERIFICATION steps marked with the word "check"
(" 23+45=68; check 23+45=68; 68-17=51 #### 51"); `concise_steps` drops exactly those, so the strict
step verifier can run on the concise form. Everything here is a pure function over strings, rows
and tensors; the pipeline (sampling, SFT/DPO, GRPO) wires them in.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from typing import Any, Callable, Literal, Mapping, Sequence

from stages.tasks import arith

# --- 1. overthinking seed traces (spec section 4) ------------------------------------------------

CHECK = "check "  # marks a re-verification step: "check 68-17=51" restates step "68-17=51"


def overthink_target(question: str, rng: random.Random, repeats: tuple[int, int] = (2, 4)) -> str:
    """A correct but verbose arith target: the concise solution plus n ~ U{repeats} re-verification
    steps, each placed right after the step it re-checks (a step may be re-checked several times).

    " 23+45=68; check 23+45=68; 68-17=51; check 68-17=51; check 68-17=51 #### 51"
    The answer after "####" is unchanged, so `arith.verify_answer` accepts it.
    """
    lo, hi = repeats
    if not 0 <= lo <= hi:
        raise ValueError(f"repeats = {repeats}: expected 0 <= low <= high")
    steps = arith.solution_steps(*arith.parse_question(question))
    checks = [0] * len(steps)
    for _ in range(rng.randint(lo, hi)):
        checks[rng.randrange(len(steps))] += 1
    pieces = []
    for step, n in zip(steps, checks):
        text = arith.format_step(step)
        pieces += [text] + [CHECK + text] * n
    return " " + "; ".join(pieces) + f" #### {steps[-1].value}"


def is_check(step: str) -> bool:
    return step.startswith(CHECK)


def concise_steps(completion: str) -> list[str]:
    """The derivation steps of a completion: `arith.parse_steps` minus re-verification steps."""
    return [s for s in arith.parse_steps(completion) if not is_check(s)]


def concise_completion(completion: str) -> str:
    """The completion rebuilt without re-verification steps (same answer), so that
    `arith.verify_steps` (index-aligned) judges the derivation instead of the verbosity."""
    tail = completion.split("####", 1)[1] if "####" in completion else None
    body = " " + "; ".join(concise_steps(completion))
    return body if tail is None else f"{body} ####{tail}"


def count_repeats(completion: str) -> int:
    """Number of re-verification steps (the injected repetition count of a seed trace)."""
    return sum(is_check(s) for s in arith.parse_steps(completion))


def seed_rows(rows: Sequence[Mapping[str, Any]], frac_verbose: float, seed: int | str,
              repeats: tuple[int, int] = (2, 4)) -> list[dict[str, Any]]:
    """Copies of arith rows where round(frac_verbose * n) targets (a seeded choice) are overthinking
    traces; adds `n_repeats` (0 for concise targets). Row order is kept."""
    if not 0.0 <= frac_verbose <= 1.0:
        raise ValueError(f"frac_verbose = {frac_verbose}: expected a share in [0, 1]")
    rng = random.Random(f"hsir-seed:{seed}")
    verbose = set(rng.sample(range(len(rows)), round(frac_verbose * len(rows))))
    out = []
    for i, row in enumerate(rows):
        new = dict(row)
        if i in verbose:
            new["target"] = overthink_target(row["question"], rng, repeats)
        new["n_repeats"] = count_repeats(new["target"])
        out.append(new)
    return out


# --- 2. VeriExit (spec section 2) -----------------------------------------------------------------

def step_char_spans(completion: str) -> list[tuple[int, int]]:
    """[start, end) of every step `arith.parse_steps` returns, as positions in `completion`."""
    body = completion.split("####", 1)[0]
    spans, start = [], 0
    for piece in body.split(";"):
        stripped = piece.strip()
        if stripped:
            first = start + piece.index(stripped)
            spans.append((first, first + len(stripped)))
        start += len(piece) + 1
    return spans


def step_result(step: str) -> int | None:
    """The value after "=" of a well-formed step `a op b=c` (a re-verification step counts with its
    restated result); None for anything else. Strict: "51+1=52" has result 52, never 51."""
    body = step[len(CHECK):] if is_check(step) else step
    m = arith._STEP.fullmatch(body)  # the step verifier's own grammar, so both agree
    return None if m is None else int(m[4])


def first_gold_step(completion: str, gold: int) -> int | None:
    """Index of the first step whose result equals `gold`, or None."""
    for k, (a, b) in enumerate(step_char_spans(completion)):
        if step_result(completion[a:b]) == gold:
            return k
    return None


def _exit_at(completion: str, k: int, gold: int) -> str:
    end = step_char_spans(completion)[k][1]
    return completion[:end] + f" #### {gold}"  # the exit cue of arith is its answer marker


def verify_then_exit(completion: str, question: str, gold: int) -> str | None:
    """VeriExit on a FAILED completion: truncate after the first step whose result is `gold` and
    append " #### gold". None when the completion is already correct or no step reaches gold.
    `question` is unused by the cut itself (kept for the interface); see `exit_is_faithful`."""
    del question
    if arith.extract_answer(completion) == gold:
        return None
    k = first_gold_step(completion, gold)
    return None if k is None else _exit_at(completion, k, gold)


def trim_after_answer(completion: str, gold: int) -> str:
    """A CORRECT completion with the redundant steps after the first gold step cut; unchanged when
    that step is already the last one or no step shows gold. Raises on a wrong completion."""
    if arith.extract_answer(completion) != gold:
        raise ValueError(f"trim_after_answer needs a correct completion (answer {gold}): "
                         f"{completion!r}; use verify_then_exit for wrong ones")
    k = first_gold_step(completion, gold)
    if k is None or k == len(step_char_spans(completion)) - 1:
        return completion
    return _exit_at(completion, k, gold)


def exit_is_faithful(truncated: str, question: str) -> bool:
    """True iff the (concise form of the) truncated solution is the question's complete true
    derivation. False flags a VeriExit false positive: gold reached as an intermediate value of a
    wrong derivation, or too early on the true path (e.g. 8 after "5+3" in "5+3-0")."""
    verdicts = arith.verify_steps({"question": question}, concise_completion(truncated))
    n_true = len(arith.parse_question(question)[1])
    return len(verdicts) == n_true and all(verdicts)


# --- 3. InDiv, intrinsic diversity (spec section 2, [reconstructed]) ---------------------------

def step_token_spans(offsets: Sequence[tuple[int, int]], char_spans: Sequence[tuple[int, int]],
                     shift: int = 0) -> list[tuple[int, int]]:
    """Token index range [first, last + 1) of each char span (moved right by `shift`, e.g. the
    prompt's length) from a fast tokenizer's `offset_mapping`. A token belongs to a step when its
    characters overlap the step's; special tokens (empty offsets) never do. With the repo's
    character tokenizer this is one token per character."""
    spans = []
    for a, b in char_spans:
        a, b = a + shift, b + shift
        hit = [t for t, (s, e) in enumerate(offsets) if e > s and s < b and e > a]
        if not hit:
            raise ValueError(f"no token covers characters [{a}, {b})")
        spans.append((hit[0], hit[-1] + 1))
    return spans


def step_embeddings(hidden: Any, attn_from_last: Any, spans: Sequence[tuple[int, int]]) -> Any:
    """E[k] = L2-normalised sum_{t in step k} w_t h_t, with w_t = attention token t receives from
    the final token, renormalised within the step (uniform if it is all zero).

    hidden: [T, d] one layer's hidden states; attn_from_last: [T] (averaged over heads by the
    caller); returns [m, d] for m spans.
    """
    import torch

    rows = []
    for a, b in spans:
        w = attn_from_last[a:b].to(hidden.dtype)
        w = w / w.sum() if w.sum() > 0 else torch.full_like(w, 1.0 / (b - a))
        rows.append(w @ hidden[a:b])  # [d]
    return torch.nn.functional.normalize(torch.stack(rows), dim=-1)


def _gram_eigenvalues(E: Any) -> Any:
    import torch

    m = E.shape[0]
    if m == 0:
        raise ValueError("InDiv needs at least one step; got an empty embedding matrix")
    G = (E @ E.T).double() / m                      # [m, m], trace 1 for unit rows
    return torch.linalg.eigvalsh(G).clamp(min=0.0)  # symmetric PSD; clamp rounding noise


def indiv_eigenscore(E: Any, eps: float = 1e-3) -> float:
    """InDiv = (1/m) sum_k log(lam_k + eps), lam = eigenvalues of G = E E^T / m (EigenScore style).

    Unit rows make trace(G) = 1, so the score is at most log(1/m + eps), reached by m orthogonal
    steps; near-duplicate steps leave eigenvalues at 0 and pull it towards log(eps). Note the cap
    falls with m: longer solutions score lower even when diverse (this formula also rewards
    brevity). m = 1: G = [1], score log(1 + eps), the formula's maximum (one step cannot repeat).
    """
    lam = _gram_eigenvalues(E)
    return float((lam + eps).log().mean())


def indiv_spectral_entropy(E: Any) -> float:
    """Normalised spectral entropy -sum p_k log p_k / log m, p = lam / sum lam, in [0, 1]:
    1 for m orthogonal steps, 0 for m identical ones; length-neutral unlike the eigenscore.
    m = 1 is defined as 1.0 (a single step has nothing to repeat). The spec z-scores it per
    query; do that on the returned values if wanted."""
    lam = _gram_eigenvalues(E)
    m = lam.shape[0]
    if m == 1:
        return 1.0
    p = lam / lam.sum()
    p = p[p > 0]                                    # 0 log 0 = 0
    return float(-(p * p.log()).sum() / math.log(m))


INDIV_METHODS: dict[str, Callable[[Any], float]] = {
    "eigenscore": indiv_eigenscore,
    "spectral_entropy": indiv_spectral_entropy,
}


def resolve_layer(layer: int | Literal["middle"], n_layers: int) -> int:
    """Decoder layer index in [0, n_layers): "middle" = the layer after which half the stack ran
    (n_layers // 2 - 1, at least 0); negative ints count from the end (-1 = last layer)."""
    index = max(n_layers // 2 - 1, 0) if layer == "middle" else int(layer)
    if not -n_layers <= index < n_layers:
        raise ValueError(f"layer = {layer!r}: the model has {n_layers} layers")
    return index % n_layers


def _set_attention(model: Any, impl: str) -> None:
    if hasattr(model, "set_attn_implementation"):  # transformers >= 4.48; 5.x checks support
        model.set_attn_implementation(impl)
    else:
        model.config._attn_implementation = impl


def indiv_scores(model: Any, tokenizer: Any, prompts: Sequence[str], completions: Sequence[str],
                 layer: int | Literal["middle"] = -1, method: str = "eigenscore",
                 batch_size: int = 16) -> list[float]:
    """InDiv of each completion under `model`, one forward pass per batch.

    The text is prompt + completion (as in training). Steps are the completion's arith steps
    (re-verification steps included: they are what InDiv should detect). Hidden states are the
    OUTPUT of decoder layer `layer` (for the last layer HF applies the final norm); attention is
    that same layer's, from the text's last token, averaged over heads. Attention maps exist only
    with eager attention, so the model is switched to "eager" for the call and switched back
    (SDPA/flash return none). Rows are right-padded, so scores do not depend on the batch.
    A completion without steps scores NaN (`keep_by_indiv` drops it).
    """
    import torch

    if method not in INDIV_METHODS:
        raise ValueError(f"method = {method!r}: expected one of {sorted(INDIV_METHODS)}")
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    score = INDIV_METHODS[method]
    index = resolve_layer(layer, model.config.num_hidden_layers)
    pad_id = tokenizer.pad_token_id
    pad_id = tokenizer.eos_token_id if pad_id is None else pad_id
    device = next(model.parameters()).device
    was_impl = model.config._attn_implementation
    _set_attention(model, "eager")
    out: list[float] = []
    try:
        for start in range(0, len(prompts), batch_size):
            texts = [p + c for p, c in zip(prompts[start:start + batch_size],
                                           completions[start:start + batch_size])]
            enc = tokenizer(texts, return_offsets_mapping=True)
            lengths = [len(ids) for ids in enc["input_ids"]]
            T = max(lengths)
            ids = torch.full((len(texts), T), pad_id, dtype=torch.long)
            mask = torch.zeros((len(texts), T), dtype=torch.long)
            for i, row in enumerate(enc["input_ids"]):
                ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
            with torch.inference_mode():
                res = model(input_ids=ids.to(device), attention_mask=mask.to(device),
                            output_hidden_states=True, output_attentions=True)
            hidden = res.hidden_states[index + 1].float()  # [B, T, d]; [0] is the embeddings
            attn = res.attentions[index].float()           # [B, heads, T, T]
            for i, n in enumerate(lengths):
                j = start + i
                chars = step_char_spans(completions[j])
                if not chars:
                    out.append(float("nan"))
                    continue
                spans = step_token_spans(enc["offset_mapping"][i], chars, shift=len(prompts[j]))
                from_last = attn[i, :, n - 1, :n].mean(0)  # [n] attention from the last token
                out.append(score(step_embeddings(hidden[i, :n], from_last, spans)))
    finally:
        _set_attention(model, was_impl)
    return out


def calibrate_threshold(scores: Sequence[float], drop_frac: float) -> float:
    """tau such that round(drop_frac * n) of the finite scores fall below it (the spec's recipe on
    a new scale: drop 20-40% of correct solutions). Ties at tau are kept, so with ties fewer
    may be dropped."""
    if not 0.0 <= drop_frac <= 1.0:
        raise ValueError(f"drop_frac = {drop_frac}: expected a share in [0, 1]")
    ranked = sorted(s for s in scores if math.isfinite(s))
    if not ranked:
        raise ValueError("calibrate_threshold needs at least one finite score")
    k = round(drop_frac * len(ranked))
    return math.nextafter(ranked[-1], math.inf) if k == len(ranked) else ranked[k]


def keep_by_indiv(scores: Sequence[float], tau: float) -> list[bool]:
    """The overthinking filter: keep iff InDiv >= tau (NaN is never kept)."""
    return [s >= tau for s in scores]


# --- 4. training pools (spec sections 2-3) and the H-GRPO reward --------------------------------
# A sample is a dict {query_id, difficulty, completion, correct, ...}; pools return new dicts.

def star_pool(samples: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """STaR: every correct sample."""
    return [{**s, "source": "correct"} for s in samples if s["correct"]]


def rest_em_pool(samples: Sequence[Mapping[str, Any]], max_per_query: int) -> list[dict[str, Any]]:
    """ReST-EM: correct samples, at most `max_per_query` per query (first ones kept)."""
    kept: dict[Any, int] = defaultdict(int)
    out = []
    for s in star_pool(samples):
        if kept[s["query_id"]] < max_per_query:
            kept[s["query_id"]] += 1
            out.append(s)
    return out


def length_filter_pool(samples: Sequence[Mapping[str, Any]],
                       keep_frac: float = 0.7) -> list[dict[str, Any]]:
    """The length baseline: STaR, then the shortest round(keep_frac * n) completions over the whole
    pool (characters = tokens with the char tokenizer; ties by order). Pool order is kept."""
    pool = star_pool(samples)
    n_keep = round(keep_frac * len(pool))
    shortest = sorted(range(len(pool)), key=lambda i: len(pool[i]["completion"]))[:n_keep]
    return [pool[i] for i in sorted(shortest)]


IndivOf = Callable[[list[dict[str, Any]]], Sequence[float]]  # pool rows -> one InDiv each


def hsir_pool(samples: Sequence[Mapping[str, Any]], question_of: Mapping[Any, str],
              gold_of: Mapping[Any, int], indiv_of: IndivOf | None, tau: float,
              use_veriexit: bool = True, use_indiv: bool = True) -> list[dict[str, Any]]:
    """The HSIR pool of one iteration: correct samples + VeriExit recoveries, then InDiv >= tau.

    Rows get `source` ("correct" | "veriexit"); VeriExit rows also `faithful` (`exit_is_faithful`,
    to report the false-positive rate) and `original_completion`; with the filter on, every
    candidate gets `indiv`. `indiv_of(rows) -> scores` is batched (e.g. `indiv_scores` over the
    rows' prompts and completions). The ablation arms: +VeriExit = (True, False), +InDiv =
    (False, True), full = (True, True); (False, False) is STaR.
    """
    pool = star_pool(samples)
    if use_veriexit:
        for s in samples:
            if s["correct"]:
                continue
            q = s["query_id"]
            cut = verify_then_exit(s["completion"], question_of[q], gold_of[q])
            if cut is not None:
                pool.append({**s, "completion": cut, "correct": True, "source": "veriexit",
                             "original_completion": s["completion"],
                             "faithful": exit_is_faithful(cut, question_of[q])})
    if not use_indiv:
        return pool
    if indiv_of is None:
        raise ValueError("use_indiv=True needs indiv_of")
    scores = list(indiv_of(pool))
    if len(scores) != len(pool):
        raise ValueError(f"indiv_of returned {len(scores)} scores for {len(pool)} rows")
    return [{**row, "indiv": s} for row, s, keep in zip(pool, scores, keep_by_indiv(scores, tau))
            if keep]


def zscore(values: Sequence[float]) -> list[float]:
    """(v - mean) / std over the finite values (population std); 0 where std is 0 or v is NaN."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return [0.0] * len(values)
    mean = sum(finite) / len(finite)
    std = math.sqrt(sum((v - mean) ** 2 for v in finite) / len(finite))
    return [(v - mean) / std if std > 0 and math.isfinite(v) else 0.0 for v in values]


def hgrpo_rewards(correct: Sequence[bool], indiv: Sequence[float], group_size: int,
                  w: float = 0.2, over: Literal["group", "correct"] = "group") -> list[float]:
    """H-GRPO: R_i = 1[correct_i] + w * z_G(InDiv_i) * 1[correct_i], groups of `group_size`
    consecutive responses to one prompt. z over the whole group ("group", the spec's reading) or
    over its correct responses only ("correct"). A group whose InDiv std is 0 gets no bonus.
    GRPO's group-normalised advantages are then computed from R as usual."""
    if len(correct) != len(indiv):
        raise ValueError(f"{len(correct)} correctness flags but {len(indiv)} InDiv scores")
    if group_size < 1 or len(correct) % group_size:
        raise ValueError(f"{len(correct)} responses do not split into groups of {group_size}")
    rewards = []
    for start in range(0, len(correct), group_size):
        ok = list(correct[start:start + group_size])
        scores = list(indiv[start:start + group_size])
        if over == "correct":
            scores = [s if c else float("nan") for s, c in zip(scores, ok)]
        z = zscore(scores)
        rewards += [float(c) + (w * zi if c else 0.0) for c, zi in zip(ok, z)]
    return rewards
