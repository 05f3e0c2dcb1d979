"""Stage `fit_fsm` of CoT-FSM: the offline phase, per trained model (spec §2 steps 1-6).

1. generate_cots: the model samples one CoT per `fit` and `val` problem (no steering);
2. label_states: each sentence labelled by its template with `label_noise` flips (the method
   sees only these labels); the verifier scores each trace (closed and u < P(success));
3. R = T_corr - T_inc on the fit CoTs (merged repeats), Q by Q-iteration (`fsm.q_iteration`);
4. hidden states at every sentence-final token, at every layer 1..L (teacher-forced on the
   model's own CoTs); steering vectors = difference of means per transition (`fsm`);
5. linear probes g_curr (current state) and g_next (next state) per layer: multinomial logistic
   regression on standardised h (the paper: an MLP encoder with a triplet loss + heads; linear
   probes here, as the issue asks [ours]);
6. the layer whose probes are most accurate on the val CoTs (g_curr + g_next accuracy against
   the labels the method has) is the steering layer.

Output per seed: `seed<k>/fsm.safetensors` (R, Q, probe weights, standardisation and the
chosen layer's vectors (6, 6, d)) and `seed<k>/fsm.json` (layer, R, Q and the planned and greedy
policies, readable).

    python -m stages cotfsm fit_fsm
"""

from __future__ import annotations

import random
from typing import Any, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from stages.cotfsm import fsm
from stages.core import io


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    gamma: float = Field(0.9, ge=0, lt=1, description="Q-iteration discount (paper: 0.9)")
    clip: float = Field(0.25, gt=0, le=10, description="R clipped to [-c, c] (paper: 0.2-0.3)")
    iterations: int = Field(100, ge=1, le=100000, description="Q-iterations (paper: 100)")
    max_new_tokens: int = Field(160, ge=8, le=4096, description="tokens per offline CoT")
    probe_c: float = Field(1.0, gt=0, description="inverse L2 strength of the probes")
    batch_size: int = Field(256, ge=1, description="prompts per generate call")
    traces: str = Field("cotfsm_traces", description="paths key of the traces folder")
    models: str = Field("cotfsm_models", description="paths key of the models folder")
    out: str = Field("cotfsm_fits", description="paths key of the output folder")
    num_threads: int = Field(0, ge=0, le=256, description="torch CPU threads (0: all cores)")


def sentence_end_hidden(model: Any, sequences: Sequence[list[int]], end_ids: Sequence[int],
                        batch_size: int = 128) -> tuple[list[np.ndarray], list[list[int]]]:
    """Per layer l = 0..L: (n, d) hidden states at every sentence-final token of `sequences`
    (in order), and per sequence the count of its sentence ends."""
    import torch

    ends = set(end_ids)
    layers: list[list[np.ndarray]] = []
    counts: list[list[int]] = []
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start:start + batch_size]
        width = max(len(s) for s in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for i, s in enumerate(chunk):          # right padding: positions stay 0..len-1
            ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
        with torch.no_grad():
            hs = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        pos = [(i, j) for i, s in enumerate(chunk) for j, t in enumerate(s) if t in ends]
        counts += [[sum(1 for t in s if t in ends)] for s in chunk]
        rows = torch.tensor([p[0] for p in pos], dtype=torch.long)
        cols = torch.tensor([p[1] for p in pos], dtype=torch.long)
        if not layers:
            layers = [[] for _ in hs]
        for l, h in enumerate(hs):
            layers[l].append(h[rows, cols].float().numpy())
    return [np.concatenate(x) for x in layers], counts


def fit_probe(x: np.ndarray, y: np.ndarray, c: float) -> tuple[np.ndarray, np.ndarray]:
    """Multinomial logistic regression -> (6, d) weights, (6,) bias; a class never seen gets
    bias -30 (never predicted)."""
    from sklearn.linear_model import LogisticRegression

    w = np.zeros((fsm.N_STATES, x.shape[1]))
    b = np.full(fsm.N_STATES, -30.0)
    classes = np.unique(y)
    if len(classes) == 1:
        b[classes[0]] = 0.0
        return w, b
    clf = LogisticRegression(C=c, max_iter=500).fit(x, y)
    if len(classes) == 2:                   # sklearn's binary form: one row for class 1
        w[classes[1]], b[classes[1]] = clf.coef_[0], clf.intercept_[0]
        b[classes[0]] = 0.0
    else:
        w[clf.classes_], b[clf.classes_] = clf.coef_, clf.intercept_
    return w, b


def label_cots(words: Sequence[Sequence[str]], difficulty: Sequence[float], ids: Sequence[str],
               weights: np.ndarray, bias: float, noise: float, seed: int) -> dict[str, list]:
    """Exact states, noisy labels (what the method sees) and correctness of each CoT."""
    from stages.cotfsm.steer import score
    from stages.cotfsm.traces import noisy_labels

    out: dict[str, list] = {"states": [], "labels": [], "correct": [], "closed": []}
    for w, u, pid in zip(words, difficulty, ids):
        ok, states, closed = score(w, u, weights, bias)
        out["states"].append(states)
        out["labels"].append(noisy_labels(states, random.Random(f"label/{seed}/{pid}"), noise))
        out["correct"].append(ok)
        out["closed"].append(closed)
    return out


def pairs(labels: Sequence[list[int]], counts: Sequence[int]) -> tuple[np.ndarray, np.ndarray,
                                                                       np.ndarray]:
    """Align sentence ends with labels: current state, next state (-1 after the last sentence)
    and a keep mask (sentence ends past the parsed states, e.g. of a malformed sentence, out)."""
    cur, nxt, keep = [], [], []
    for lab, n in zip(labels, counts):
        for j in range(n):
            ok = j < len(lab)
            cur.append(lab[j] if ok else -1)
            nxt.append(lab[j + 1] if j + 1 < len(lab) else -1)
            keep.append(ok)
    return np.array(cur), np.array(nxt), np.array(keep, dtype=bool)


def advantage_or_zero(labels: Sequence[list[int]], correct: Sequence[bool]
                      ) -> tuple[np.ndarray, bool]:
    """R, or a zero R (no evidence: Q-value steering then never intervenes) when the model's
    CoTs are all correct or all wrong, e.g. an undertrained smoke model; flagged in the metrics."""
    if all(correct) or not any(correct):
        print(f"fit_fsm: WARNING: {sum(correct)} of {len(correct)} CoTs correct; R = 0")
        return np.zeros((fsm.N_STATES, fsm.N_STATES)), True
    return fsm.advantage_matrix(labels, correct), False


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    from safetensors.numpy import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.cotfsm.steer import sample_cots
    from stages.cotfsm.traces import SENTENCE_END, read_split, read_task
    from stages.models.base import set_threads

    set_threads(cfg.num_threads)
    weights, bias, noise = read_task(ctx.path(cfg.traces))
    data = {s: read_split(ctx.path(cfg.traces), s) for s in ("fit", "val")}
    mdir = ctx.path(cfg.models)
    seeds = sorted(int(d.name[4:]) for d in mdir.iterdir() if d.name.startswith("seed"))
    metrics: dict[str, float] = {}
    with io.atomic_path(ctx.path(cfg.out), is_dir=True) as tmp:
        for seed in seeds:
            tokenizer = AutoTokenizer.from_pretrained(str(mdir / f"seed{seed}"),
                                                      local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(str(mdir / f"seed{seed}"),
                                                         local_files_only=True).eval()
            end_ids = tokenizer.convert_tokens_to_ids(list(SENTENCE_END))
            got, lab, hid = {}, {}, {}
            for split, df in data.items():
                got[split] = sample_cots(model, tokenizer, df["prompt"].to_list(),
                                         cfg.max_new_tokens, seed=seed * 31 + len(split),
                                         batch_size=cfg.batch_size)
                lab[split] = label_cots(got[split]["words"], df["difficulty"].to_list(),
                                        df["id"].to_list(), weights, bias, noise, seed)
                hs, counts = sentence_end_hidden(model, got[split]["sequences"], end_ids)
                cur, nxt, keep = pairs(lab[split]["labels"], [c[0] for c in counts])
                hid[split] = (hs, cur, nxt, keep)
                metrics[f"seed{seed}/{split}/acc"] = float(np.mean(lab[split]["correct"]))
                metrics[f"seed{seed}/{split}/closed"] = float(np.mean(lab[split]["closed"]))
            r, degenerate = advantage_or_zero(lab["fit"]["labels"], lab["fit"]["correct"])
            metrics[f"seed{seed}/degenerate_r"] = float(degenerate)
            q = fsm.q_iteration(r, cfg.gamma, cfg.clip, cfg.iterations)
            # The same from the exact states: how far 10% label noise moves the planner.
            r_true, _ = advantage_or_zero(lab["fit"]["states"], lab["fit"]["correct"])
            q_true = fsm.q_iteration(r_true, cfg.gamma, cfg.clip, cfg.iterations)
            metrics[f"seed{seed}/policy_agreement_vs_exact_labels"] = float(np.mean(
                q.argmax(1)[:-1] == q_true.argmax(1)[:-1]))
            best, fitted = None, {}
            hs_fit, cur_f, nxt_f, keep_f = hid["fit"]
            hs_val, cur_v, nxt_v, keep_v = hid["val"]
            for layer in range(1, len(hs_fit)):
                x, xv = hs_fit[layer][keep_f], hs_val[layer][keep_v]
                mean, scale = x.mean(0), x.std(0) + 1e-6
                z, zv = (x - mean) / scale, (xv - mean) / scale
                has_next, has_next_v = nxt_f[keep_f] >= 0, nxt_v[keep_v] >= 0
                cw, cb = fit_probe(z, cur_f[keep_f], cfg.probe_c)
                nw, nb = fit_probe(z[has_next], nxt_f[keep_f][has_next], cfg.probe_c)
                acc_c = float(np.mean((zv @ cw.T + cb).argmax(1) == cur_v[keep_v]))
                acc_n = float(np.mean((zv[has_next_v] @ nw.T + nb).argmax(1)
                                      == nxt_v[keep_v][has_next_v]))
                metrics[f"seed{seed}/L{layer}/probe_curr_acc"] = acc_c
                metrics[f"seed{seed}/L{layer}/probe_next_acc"] = acc_n
                vectors = fsm.steering_vectors(x[has_next], cur_f[keep_f][has_next],
                                               nxt_f[keep_f][has_next])
                fitted[layer] = {"mean": mean, "scale": scale, "curr_w": cw, "curr_b": cb,
                                 "next_w": nw, "next_b": nb, "vectors": vectors}
                if best is None or acc_c + acc_n > best[1]:
                    best = (layer, acc_c + acc_n)
            assert best is not None
            layer = best[0]
            metrics[f"seed{seed}/layer"] = float(layer)
            arrays = {k: np.ascontiguousarray(v, dtype=np.float32)
                      for k, v in fitted[layer].items()}
            arrays |= {"R": r.astype(np.float32), "Q": q.astype(np.float32)}
            folder = tmp / f"seed{seed}"
            folder.mkdir()
            save_file(arrays, str(folder / "fsm.safetensors"))
            io.write_json(folder / "fsm.json", {
                "layer": layer,
                "R": r.round(6).tolist(), "Q": q.round(6).tolist(),
                "policy": [fsm.STATES[j] for j in q.argmax(1)],
                "greedy": [fsm.STATES[j] for j in r.argmax(1)]})
            for i, s in enumerate(fsm.STATES):
                metrics[f"seed{seed}/policy/{s}"] = float(q.argmax(1)[i])
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: the chosen layer and its g_next val accuracy (means over seeds); per seed
    and layer, g_curr and the unsteered accuracy in details/fit_fsm.json."""
    seeds = sorted({k.split("/")[0] for k in metrics if k.endswith("/layer")})
    if not seeds:
        return {}
    layer = {s: int(metrics[f"{s}/layer"]) for s in seeds}
    return {"layer": float(np.mean(list(layer.values()))),
            "probe_next": float(np.mean([metrics[f"{s}/L{layer[s]}/probe_next_acc"]
                                         for s in seeds]))}
