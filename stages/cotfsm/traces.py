"""Stage `traces` of CoT-FSM: the task family of state-templated chains of thought.

A problem is a prompt `Solve a + b = x <think>` with a hidden difficulty u ~ U(0, 1). A chain of
thought is a walk of a Markov chain over the six states (init first, closure last, at most
`max_sentences`); each sentence comes from its state's template family, so the generating
template is an exact labeller (spec §4):

    init       We need to find x .            | Let us restate the problem .
    deduce     Then x = 7 .                   | Compute 3 + 4 = 7 .
    augment    Try substituting y = 5 .       | Consider a new variable .
    uncertain  Hmm , not sure this is right . | Wait , is that correct ?
    backtrack  Actually , redo step 2 .       | Revisit step 2 !
    closure    So the answer is 42 .          | Therefore x = 42 .

Success depends on the transitions visited: a trace that reaches closure is correct iff
u < sigmoid(bias + sum of `weights` over its merged transitions) (`fsm.success_probability`);
uncertain -> backtrack -> deduce pays, closing while uncertain costs [ours]. The difficulty is
fixed per problem, so every arm meets the same problems at the same difficulty (paired).

Lookahead cue [ours]: every non-final sentence ends with a cue word of where the reasoning goes
next (`then` deduce, `instead` augment, `maybe` uncertain, `oops` backtrack, `done` closure;
right with probability `cue_match`, else another at random), as real CoTs do ("wait",
"alternatively"). Without it a Markov sampler holds no plan in its residual stream at a sentence
end, and a difference of means over next states has nothing to read or write.

State labels seen by the method carry `label_noise` (10%) flips to another state at random, to
mimic an LLM labeller (spec §4); the verifier uses the exact states.

Outputs (`paths.cotfsm_traces`): `lm_train.parquet` (traces the tiny model learns from),
`fit.parquet`, `val.parquet`, `test.parquet` (problems only: the offline phase, layer choice
and the steering arms) and `tokenizer/` (a word-level `PreTrainedTokenizerFast`).

    python -m stages cotfsm traces
"""

from __future__ import annotations

import random
from typing import Any, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stages.cotfsm.fsm import CLOSURE, INIT, N_STATES, STATES, success_probability
from stages.core import io

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
THINK = "<think>"
SENTENCE_END = (".", "?", "!")
TEMPLATES: dict[int, tuple[str, ...]] = {
    0: ("We need to find x", "Let us restate the problem"),
    1: ("Then x = {n}", "Compute {a} + {b} = {n}"),
    2: ("Try substituting y = {n}", "Consider a new variable"),
    3: ("Hmm , not sure this is right", "Wait , is that correct"),
    4: ("Actually , redo step {k}", "Revisit step {k}"),
    5: ("So the answer is {n}", "Therefore x = {n}"),
}
FIRST_WORD = {t.split()[0]: s for s, ts in TEMPLATES.items() for t in ts}   # the exact labeller
CUES = ("", "then", "instead", "maybe", "oops", "done")     # by next state; init is never next
SPLITS = ("lm_train", "fit", "val", "test")


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sizes: dict[str, int] = Field(description="rows per split: lm_train (traces), fit, val, "
                                              "test (problems)")
    chain: list[list[float]] = Field(description="6x6 generating Markov chain P(next | state), "
                                                 "rows in STATES order; closure's row is ignored")
    weights: list[list[float]] = Field(description="6x6 success weight of each merged "
                                                   "transition (the task's ground truth)")
    bias: float = Field(-0.5, description="success logit of a trace with no transition weight")
    max_sentences: int = Field(12, ge=3, le=64, description="a generated trace is cut here and "
                                                            "closed")
    cue_match: float = Field(0.75, ge=0, le=1, description="P(the cue names the true next state)")
    label_noise: float = Field(0.1, ge=0, lt=1, description="P(a state label is flipped)")
    max_number: int = Field(20, ge=2, le=999, description="numbers in sentences are 0..this")
    out: str = Field("cotfsm_traces", description="paths key of the output folder")

    @field_validator("sizes")
    @classmethod
    def _sizes(cls, v: dict[str, int]) -> dict[str, int]:
        if set(v) != set(SPLITS) or any(n < 2 for n in v.values()):
            raise ValueError(f"sizes = {v}: expected every split of {SPLITS} with >= 2 rows")
        return v

    @model_validator(mode="after")
    def _matrices(self) -> "Config":
        for name in ("chain", "weights"):
            m = np.asarray(getattr(self, name), dtype=float)
            if m.shape != (N_STATES, N_STATES) or not np.isfinite(m).all():
                raise ValueError(f"{name}: expected a finite {N_STATES}x{N_STATES} matrix "
                                 f"(rows/columns {STATES}), got shape {m.shape}")
        p = np.asarray(self.chain)
        for i in range(N_STATES - 1):      # closure ends the trace: its row is unused
            if (p[i] < 0).any() or abs(p[i].sum() - 1) > 1e-6 or p[i, INIT] != 0:
                raise ValueError(f"chain row {STATES[i]!r} = {p[i].tolist()}: expected "
                                 f"probabilities summing to 1 with P(init) = 0")
        return self


def sentence(state: int, next_state: int | None, rng: random.Random, cfg: Config) -> str:
    """One sentence of `state` with the lookahead cue of `next_state` (none after closure)."""
    words = rng.choice(TEMPLATES[state]).format(
        n=rng.randint(0, cfg.max_number), a=rng.randint(0, cfg.max_number),
        b=rng.randint(0, cfg.max_number), k=rng.randint(1, 9))
    if next_state is not None:
        cue = (next_state if rng.random() < cfg.cue_match
               else rng.choice([s for s in range(1, N_STATES) if s != next_state]))
        words += f" , {CUES[cue]}"
    end = "?" if words.startswith("Wait") else "!" if words.startswith("Revisit") else "."
    return f"{words} {end}"


def sample_states(rng: random.Random, chain: np.ndarray, max_sentences: int) -> list[int]:
    """init, then the chain until closure; cut and closed at `max_sentences`."""
    states = [INIT]
    while states[-1] != CLOSURE:
        if len(states) == max_sentences - 1:
            states.append(CLOSURE)
            break
        states.append(rng.choices(range(N_STATES), weights=chain[states[-1]])[0])
    return states


def noisy_labels(states: Sequence[int], rng: random.Random, noise: float) -> list[int]:
    """Each label flipped to another state, uniformly, with probability `noise`."""
    return [rng.choice([t for t in range(N_STATES) if t != s]) if rng.random() < noise else s
            for s in states]


def parse_states(words: Sequence[str]) -> tuple[list[int], bool]:
    """Generated words (after `<think>`) -> the state of every complete sentence, by its first
    word (the exact labeller), and whether the trace ended with closure then `<eos>`. A sentence
    opening with an unknown word makes the trace malformed: states up to it, False."""
    states, current = [], []
    for w in words:
        if w in (EOS, PAD):
            break
        current.append(w)
        if w in SENTENCE_END:
            if current[0] not in FIRST_WORD:
                return states, False
            states.append(FIRST_WORD[current[0]])
            current = []
    closed = (bool(states) and states[-1] == CLOSURE and not current and EOS in words)
    return states, closed


def vocabulary(max_number: int) -> list[str]:
    words = {w for ts in TEMPLATES.values() for t in ts for w in t.split() if "{" not in w}
    words |= {"Solve", "+", "=", "x", ",", *SENTENCE_END, *(c for c in CUES if c)}
    words |= {str(i) for i in range(max(max_number, 9) + 1)}
    return [PAD, BOS, EOS, UNK, THINK] + sorted(words)


def build_tokenizer(max_number: int) -> Any:
    """Word-level tokenizer: one token per whitespace-separated word, so a sentence-final token
    is exactly `.`/`?`/`!` (no decimals here; spec §6 warns of `.` inside numbers)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(vocabulary(max_number))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)   # joins words with spaces
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK,
        additional_special_tokens=[THINK], padding_side="left",
        clean_up_tokenization_spaces=False, model_max_length=1024)


def make_split(split: str, n: int, seed: int, cfg: Config) -> list[dict[str, Any]]:
    rng = random.Random(f"cotfsm/{split}/{seed}")
    chain, weights = np.asarray(cfg.chain), np.asarray(cfg.weights)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, cfg.max_number), rng.randint(0, cfg.max_number)
        row: dict[str, Any] = {"id": f"{split}-{i:05d}", "prompt": f"Solve {a} + {b} = x {THINK}",
                               "difficulty": rng.random()}
        if split == "lm_train":
            states = sample_states(rng, chain, cfg.max_sentences)
            text = " ".join(sentence(s, states[j + 1] if j + 1 < len(states) else None, rng, cfg)
                            for j, s in enumerate(states))
            p = success_probability(states, weights, cfg.bias)
            row |= {"target": text, "states": states,
                    "labels": noisy_labels(states, rng, cfg.label_noise),
                    "correct": row["difficulty"] < p}
        rows.append(row)
    return rows


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import polars as pl

    tokenizer = build_tokenizer(cfg.max_number)
    metrics: dict[str, float] = {"vocab_size": float(len(tokenizer))}
    with io.atomic_path(ctx.path(cfg.out), is_dir=True) as tmp:
        for split in SPLITS:
            rows = make_split(split, cfg.sizes[split], ctx.seed, cfg)
            io.write_parquet(tmp / f"{split}.parquet", pl.DataFrame(rows))
            metrics[f"{split}/rows"] = float(len(rows))
            if split == "lm_train":
                metrics["lm_train/acc"] = float(np.mean([r["correct"] for r in rows]))
                metrics["lm_train/sentences_mean"] = float(np.mean([len(r["states"])
                                                                    for r in rows]))
                flips = [a != b for r in rows for a, b in zip(r["states"], r["labels"])]
                metrics["lm_train/label_noise"] = float(np.mean(flips))
                ids = tokenizer([r["prompt"] + " " + r["target"] for r in rows])["input_ids"]
                metrics["lm_train/tokens_mean"] = float(np.mean([len(x) for x in ids]))
                metrics["lm_train/unk"] = float(sum(x.count(tokenizer.unk_token_id)
                                                    for x in ids))
        tokenizer.save_pretrained(str(tmp / "tokenizer"))
        # The task's ground truth: the verifier of later stages reads it (never the method).
        io.write_json(tmp / "task.json", {"weights": cfg.weights, "bias": cfg.bias,
                                          "label_noise": cfg.label_noise})
    if metrics["lm_train/unk"]:
        raise ValueError(f"{metrics['lm_train/unk']:.0f} unknown words in the traces: the "
                         f"vocabulary misses a template word")
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: the share of correct training traces (the rest in details/traces.json)."""
    return {"trace_acc": metrics["lm_train/acc"]} if "lm_train/acc" in metrics else {}


def trace_spec(split: str) -> Any:
    """Checked read of a split written by `run` (the next stages read through it)."""
    import polars as pl

    from stages.core.checks import spec_from_schema

    schema: dict[str, Any] = {"id": pl.String, "prompt": pl.String, "difficulty": pl.Float64}
    rules: dict[str, dict[str, Any]] = {"id": {"unique": True}, "difficulty": {"min": 0, "max": 1}}
    if split == "lm_train":
        schema |= {"target": pl.String, "states": pl.List(pl.Int64),
                   "labels": pl.List(pl.Int64), "correct": pl.Boolean}
        rules |= {"states": {"min_len": 2}}
    return spec_from_schema(schema, **rules)


def read_task(folder: Any) -> tuple[np.ndarray, float, float]:
    """(weights, bias, label_noise) of the task, checked."""
    from pathlib import Path

    from stages.core.checks import read_json_checked

    task = read_json_checked(Path(folder) / "task.json",
                             {"weights": list, "bias": float, "label_noise": float})
    weights = np.asarray(task["weights"], dtype=float)
    if weights.shape != (N_STATES, N_STATES):
        raise ValueError(f"{folder}/task.json: weights of shape {weights.shape}, expected "
                         f"({N_STATES}, {N_STATES})")
    return weights, float(task["bias"]), float(task["label_noise"])


def read_split(folder: Any, split: str) -> Any:
    from pathlib import Path

    from stages.core.checks import read_parquet_checked

    return read_parquet_checked(Path(folder) / f"{split}.parquet", trace_spec(split))
