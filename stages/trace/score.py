"""Stage `score` of the TRACE pipeline: sample CoTs from every generator condition and score them.

For each policy checkpoint (stage `policy`) and sampling temperature: `num_samples` completions
per held-out prompt; per sample the exact answer check, the response length (characters), its
perplexity under the model that wrote it (the perplexity baseline), and TRACE:
split the CoT (text before `####`) into sentences, tag each with the 8-label tagger (stage
`label`, or an LLM labeler through the backend interface), then `trace.trace_score` with the
params' tables (`tables.version` is stored with every number, spec §6).

    <out>/samples.parquet    condition, temperature, prompt id, completion, correct, length,
                             nll, n_sentences, labels, empty_sets, v_state, c_trans, trace

    python -m stages trace score
"""

from __future__ import annotations

import math
from typing import Any, Literal

import polars as pl
from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.core import io
from stages.core.checks import read_parquet_checked, read_json_checked
from stages.models.backend import BackendConfig
from stages.tasks import arith
from stages.trace import trace


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policies: str = Field("policies", description="paths key of the policy folder")
    corpus: str = Field("corpus", description="paths key of the corpus (test.parquet)")
    tagger: str = Field("tagger", description="paths key of the tagger folder")
    out: str = Field("scores", description="paths key of the output folder")
    tables: trace.Tables = Field(default_factory=trace.Tables,
                                 description="S_allowed, transition weights, alpha")
    labeler: Literal["classifier", "llm"] = Field("classifier",
                                                  description="who labels the sentences")
    llm: BackendConfig | None = Field(None, description="the LLM labeler's backend "
                                                        "(labeler: llm)")
    temperatures: list[float] = Field([1.0], min_length=1, description="sampling temperatures")
    num_samples: int = Field(4, ge=1, le=1024, description="samples per prompt")
    n_prompts: int | None = Field(None, ge=1, description="held-out prompts used (None: all)")
    max_new_tokens: int = Field(230, ge=8, le=32768)
    batch_size: int = Field(256, ge=1, le=65536, description="sequences decoded together")
    num_threads: int = Field(0, ge=0, le=256)

    @model_validator(mode="after")
    def _check(self) -> "Config":
        if self.labeler == "llm" and self.llm is None:
            raise ValueError("labeler = llm needs an `llm` backend block")
        if any(t <= 0 for t in self.temperatures):
            raise ValueError(f"temperatures {self.temperatures}: must be > 0")
        return self


def sequence_nll(model: Any, tokenizer: Any, prompts: list[str], completions: list[str],
                 batch_size: int = 64) -> list[float]:
    """Mean per-token negative log-likelihood of each completion (+ <eos>) given its prompt."""
    import torch

    from stages.models.base import CompletionCollator, encode_sft_rows

    rows = encode_sft_rows(tokenizer, prompts, completions, model.config.max_position_embeddings)
    collate = CompletionCollator(tokenizer.pad_token_id)
    out: list[float] = []
    with torch.inference_mode():
        for i in range(0, len(rows), batch_size):
            b = {k: v.to(model.device) for k, v in collate(rows[i:i + batch_size]).items()}
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            logp = torch.log_softmax(logits[:, :-1].float(), -1)
            labels = b["labels"][:, 1:]
            mask = labels != -100
            tok = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            nll = -(tok * mask).sum(1) / mask.sum(1).clamp(min=1)
            out += nll.tolist()
    return out


def make_tagger(cfg: Config, ctx: Any) -> Any:
    if cfg.labeler == "llm":
        from stages.models.backend import make_backend

        assert cfg.llm is not None
        return trace.LLMTagger(make_backend(cfg.llm, root=ctx.root))
    return trace.ClassifierTagger.load(ctx.path(cfg.tagger))


def score_completions(tagger: Any, completions: list[str], tables: trace.Tables
                      ) -> list[dict[str, Any]]:
    """TRACE and its parts for each completion (its CoT block), with the label sequence."""
    seqs = trace.tag_cots(tagger, [trace.cot_block(c) for c in completions])
    out = []
    for seq in seqs:
        s = trace.trace_score(seq, tables)
        out.append({**s, "n_sentences": len(seq), "empty_sets": sum(1 for l in seq if not l),
                    "labels": [trace.labels_str(l) for l in seq]})
    return out


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    from stages.models.base import set_threads
    from stages.models.generate import generate, load_model

    set_threads(cfg.num_threads)
    tests = read_parquet_checked(ctx.path(cfg.corpus) / "test.parquet",
                                 arith.expectations(None, "test")).to_dicts()
    tests = tests[: cfg.n_prompts] if cfg.n_prompts else tests
    conditions = read_json_checked(ctx.path(cfg.policies) / "conditions.json", kind=list)
    tagger = make_tagger(cfg, ctx)
    frames, metrics = [], {}
    for cond in conditions:
        model, tokenizer = load_model(ctx.path(cfg.policies) / cond["condition"])
        for temp in cfg.temperatures:
            outs = generate(model, tokenizer, [r["prompt"] for r in tests],
                            max_new_tokens=cfg.max_new_tokens, do_sample=True, temperature=temp,
                            num_samples=cfg.num_samples, batch_size=cfg.batch_size, seed=ctx.seed)
            rows, prompts, comps = [], [], []
            for r, samples in zip(tests, outs):
                for k, c in enumerate(samples):
                    rows.append({"id": r["id"], "sample": k, "completion": c,
                                 "correct": arith.verify_answer(r, c), "length": len(c)})
                    prompts.append(r["prompt"]), comps.append(c)
            nll = sequence_nll(model, tokenizer, prompts, comps)
            scored = score_completions(tagger, comps, cfg.tables)
            name = f"{cond['condition']}_t{temp:g}"
            df = pl.DataFrame([{**r, **s, "nll": n} for r, s, n in zip(rows, scored, nll)])
            df = df.with_columns(pl.lit(name).alias("condition"),
                                 pl.lit(cond["condition"]).alias("policy"),
                                 pl.lit(cond["mix"]).alias("mix"),
                                 pl.lit(cond["steps"]).alias("steps"),
                                 pl.lit(temp).alias("temperature"))
            frames.append(df)
            metrics[f"{name}/acc"] = float(df["correct"].mean())
            metrics[f"{name}/trace"] = float(df["trace"].mean())
            ctx.log_metrics({f"{name}/acc": metrics[f"{name}/acc"],
                             f"{name}/trace": metrics[f"{name}/trace"]})
            print(f"score: {name}: accuracy {metrics[f'{name}/acc']:.3f}, "
                  f"TRACE {metrics[f'{name}/trace']:.3f}")
    samples = pl.concat(frames, how="vertical_relaxed")
    with io.atomic_path(ctx.path(cfg.out), is_dir=True) as tmp:
        io.write_parquet(tmp / "samples.parquet", samples)
        io.write_json(tmp / "tables.json", cfg.tables.model_dump())
    n_sent = int(samples["n_sentences"].sum())
    metrics["samples"] = float(samples.height)
    metrics["empty_set_rate"] = float(samples["empty_sets"].sum()) / max(1, n_sent)
    metrics["no_sentence_rate"] = float((samples["n_sentences"] == 0).mean())
    metrics["labeler_malformed"] = float(getattr(tagger, "malformed", 0))
    metrics["mean_trace"] = float(samples["trace"].mean())
    metrics["mean_acc"] = float(samples["correct"].mean())
    if any(math.isnan(v) for v in metrics.values()):
        raise ValueError(f"score: NaN in metrics {metrics}")
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: accuracy and TRACE over all sampled CoTs; per condition in
    details/score.json."""
    return {k: metrics[k] for k in ("mean_acc", "mean_trace") if k in metrics}
