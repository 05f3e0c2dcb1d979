"""BridgeVLM's causal module: latent variables from the images, a soft DAG over them, RAMP
message passing, and the Causal Tokens the decoder reads (BridgeVLM spec §2; arXiv 2606.11745).

    V = visual tokens of the (before, after) images        (2N, d), + a learned block embedding
    Z = CrossAttn(Q_var, V) + FFN                          (m, d)   variable extraction
    A_ij = sigmoid((P z_i)^T (R z_j) / (tau sqrt(r))), A_ii = 0      low-rank soft DAG
    RAMP, K times:  msg_dn_i = sum_j A_ji W_dn h_j   (from parents)
                    msg_up_i = sum_j A_ij W_up h_j   (from children)
                    h_i <- h_i + MLP([h_i; msg_dn_i; msg_up_i])
                    G = CrossAttn(Q_graph, H); h_i <- h_i + W_g mean(G)
    Causal Tokens = Proj([H; G])  -> spliced into the decoder input after the visual tokens
    in the decoder, after each layer l in `decoder_layers`, at the node-token positions only:
                    x_i <- x_i + MLP_l([x_i; sum_j A_ji W_dn,l x_j; sum_j A_ij W_up,l x_j])

M3S (spec §2, weights [reconstructed]): BCE on labelled edges, InfoNCE of node i against the
description of variable i (the decoder's own, detached embedding of the variable's name),
NOTEARS h(A) = tr(exp(A o A)) - m (ramped up), a graph-level head on mean(G) and, [ours], a
node-state head (the node's variable level before and after). Every term is masked where its
label is missing (edges of an SCM held out from edge supervision).

Placement (spec §2 reconciles the abstract's "injected into the decoder" with the digest's
"concatenated into the decoder input"): the Causal Tokens go into the input after the visual
tokens, and at 2-3 decoder layers the RAMP residual updates the node-token positions again with
the same A, while every other token attends to them normally ([reconstructed]; the layers are
`CausalSpec.decoder_layers`; the graph pooling and its feedback are not repeated there, and
graph-token positions are left as they are). Each decoder update has its own W_dn, W_up and MLP,
whose last layer starts at zero ([ours]), so a model starts as its input-concat twin and learns
how much in-decoder message passing to use. The arm `bridgevlm_concat` (input-concat only) is the
ablation spec §6 asks for. Structure F1 is computed after Hungarian alignment of nodes to
variables on the alignment scores.

The math is small pure functions (tested on hand values in tests/unit/test_bridgevlm.py); the
module below only wires them.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn


class CausalSpec(BaseModel):
    """Shape of the causal module (spec §4: m = 4, r = 8, K = 2, g = 2)."""

    model_config = ConfigDict(extra="forbid")

    nodes: int = Field(4, ge=2, le=64, description="m latent variable nodes (>= the SCM's "
                                                   "variables; node i is aligned to variable i)")
    rank: int = Field(8, ge=1, le=512, description="r: rank of the edge factorisation P, R")
    ramp_layers: int = Field(2, ge=0, le=8, description="K: RAMP message-passing rounds")
    graph_queries: int = Field(2, ge=1, le=32, description="g: global graph tokens")
    temperature: float = Field(1.0, gt=0, le=100, description="tau in the edge logit")
    heads: int = Field(4, ge=1, le=64, description="cross-attention heads")
    decoder_layers: list[int] = Field(
        default_factory=lambda: [1, 2], max_length=8,
        description="decoder layers (0-based) after which the RAMP residual updates the "
                    "node-token positions with the same A (spec §2: 2-3 layers "
                    "[reconstructed]); used by arms with decoder_ramp")

    @field_validator("decoder_layers")
    @classmethod
    def _layers(cls, value: list[int]) -> list[int]:
        if any(v < 0 for v in value) or sorted(set(value)) != value:
            raise ValueError(f"decoder_layers {value} must be distinct layer indices >= 0, in "
                             f"increasing order")
        return value


# --- the math (pure functions) --------------------------------------------------------------

def acyclicity(a: torch.Tensor) -> torch.Tensor:
    """NOTEARS h(A) = tr(exp(A o A)) - m (Zheng et al. 2018; spec §2): 0 exactly when the
    weighted graph has no directed cycle, > 0 otherwise. Works on (..., m, m)."""
    m = a.shape[-1]
    return torch.linalg.matrix_exp(a * a).diagonal(dim1=-2, dim2=-1).sum(-1) - m


def edge_matrix(z: torch.Tensor, p: torch.Tensor, r: torch.Tensor, tau: float) -> torch.Tensor:
    """A_ij = sigmoid((P z_i)^T (R z_j) / (tau sqrt(rank))) with A_ii = 0 (spec §2, low rank +
    sigmoid). z: (..., m, d); p, r: (rank, d)."""
    rank = p.shape[0]
    logits = (z @ p.T) @ (z @ r.T).transpose(-1, -2) / (tau * math.sqrt(rank))
    eye = torch.eye(z.shape[-2], dtype=z.dtype, device=z.device)
    return torch.sigmoid(logits) * (1 - eye)


def ramp_messages(a: torch.Tensor, h: torch.Tensor, w_dn: torch.Tensor, w_up: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(msg_dn, msg_up): msg_dn_i = sum_j A_ji W_dn h_j (from parents j -> i), msg_up_i =
    sum_j A_ij W_up h_j (from children i -> j). a: (..., m, m); h: (..., m, d); w: (d, d)."""
    return a.transpose(-1, -2) @ (h @ w_dn.T), a @ (h @ w_up.T)


def align_nodes(score: Any) -> list[int]:
    """Hungarian alignment: perm[k] = the node assigned to variable k, maximising the summed
    score (score[node, variable], nodes >= variables). scipy's linear_sum_assignment."""
    import numpy as np
    from scipy.optimize import linear_sum_assignment

    s = np.asarray(score, dtype=float)
    if s.shape[0] < s.shape[1]:
        raise ValueError(f"{s.shape[0]} nodes cannot cover {s.shape[1]} variables")
    var_idx, node_idx = linear_sum_assignment(s.T, maximize=True)   # rows: variables
    perm = [0] * s.shape[1]
    for k, node in zip(var_idx, node_idx):
        perm[int(k)] = int(node)
    return perm


def permute_edges(a: Any, perm: Sequence[int]) -> Any:
    """The node-indexed edge matrix read in variable order: out[k, l] = a[perm[k], perm[l]]."""
    idx = list(perm)
    return a[..., idx, :][..., :, idx]


def structure_f1(pred: Any, truth: Any, *, hard: bool, threshold: float = 0.5) -> float:
    """F1 over directed edges (diagonal excluded). hard: pred thresholded at `threshold`;
    soft: TP = sum A T, FP = sum A (1 - T), FN = sum (1 - A) T with A in [0, 1].
    A graph with no true and no predicted edge scores 1."""
    import numpy as np

    p = np.asarray(pred, dtype=float)
    t = np.asarray(truth, dtype=float)
    off = 1 - np.eye(p.shape[-1])
    if hard:
        p = (p >= threshold).astype(float)
    tp = float((p * t * off).sum())
    fp = float((p * (1 - t) * off).sum())
    fn = float(((1 - p) * t * off).sum())
    return 1.0 if tp + fp + fn == 0 else 2 * tp / (2 * tp + fp + fn)


def info_nce(nodes: torch.Tensor, descriptions: torch.Tensor, temperature: float) -> torch.Tensor:
    """Mean InfoNCE of node i against description i among all descriptions (cosine / T).
    nodes: (B, m, d) (the first k nodes are scored); descriptions: (k, d)."""
    k = descriptions.shape[0]
    z = nn.functional.normalize(nodes[:, :k], dim=-1)
    e = nn.functional.normalize(descriptions, dim=-1)
    logits = z @ e.T / temperature                       # (B, k, k)
    target = torch.arange(k, device=nodes.device).expand(nodes.shape[0], k)
    return nn.functional.cross_entropy(logits.reshape(-1, k), target.reshape(-1))


def alignment_scores(nodes: torch.Tensor, descriptions: torch.Tensor) -> torch.Tensor:
    """(B, m, k) cosine of every node with every variable description (Hungarian input)."""
    z = nn.functional.normalize(nodes, dim=-1)
    e = nn.functional.normalize(descriptions, dim=-1)
    return z @ e.T


def ramp_weight(step: int, steps: int, weight: float, ramp: float) -> float:
    """lambda_d ramped linearly from 0 to `weight` over the first `ramp` fraction of training
    (spec §2: 'ramp it up'); ramp 0: constant."""
    if ramp <= 0:
        return weight
    return weight * min(1.0, step / max(1.0, ramp * steps))


# --- the module -----------------------------------------------------------------------------

class CausalModule(nn.Module):
    """Variable extraction, soft DAG, RAMP, graph tokens -> Causal Tokens (module docstring).

    `dag` False: A is all-ones off the diagonal (the no-DAG ablation: no edge or acyclicity
    loss; the graph tokens and their graph head stay). `node_tokens` /
    `graph_tokens` False: those tokens are left out of the decoder input (graph tokens off also
    drops the graph feedback and the graph head: the no-global-tokens ablation).
    `decoder_ramp`: weights for the in-decoder RAMP residual at `spec.decoder_layers`
    (`decoder_update`); it acts on node-token positions, so it is off without node tokens."""

    def __init__(self, d: int, spec: CausalSpec, variables: int, levels: int, *, dag: bool = True,
                 node_tokens: bool = True, graph_tokens: bool = True,
                 decoder_ramp: bool = False):
        super().__init__()
        if not (node_tokens or graph_tokens):
            raise ValueError("a causal arm needs node tokens, graph tokens or both")
        m, g = spec.nodes, spec.graph_queries
        self.spec, self.dag = spec, dag
        self.node_tokens, self.graph_tokens = node_tokens, graph_tokens
        self.variables, self.levels = variables, levels
        self.block = nn.Parameter(torch.randn(2, d) * 0.02)            # before / after
        self.q_var = nn.Parameter(torch.randn(m, d) * 0.02)
        self.var_attn = nn.MultiheadAttention(d, spec.heads, batch_first=True)
        self.var_norm = nn.LayerNorm(d)
        self.var_ffn = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.p = nn.Parameter(torch.randn(spec.rank, d) / math.sqrt(d))
        self.r = nn.Parameter(torch.randn(spec.rank, d) / math.sqrt(d))
        self.w_dn = nn.ParameterList([nn.Parameter(torch.randn(d, d) / math.sqrt(d))
                                      for _ in range(spec.ramp_layers)])
        self.w_up = nn.ParameterList([nn.Parameter(torch.randn(d, d) / math.sqrt(d))
                                      for _ in range(spec.ramp_layers)])
        self.ramp_mlp = nn.ModuleList([nn.Sequential(nn.LayerNorm(3 * d), nn.Linear(3 * d, d),
                                                     nn.GELU(), nn.Linear(d, d))
                                       for _ in range(spec.ramp_layers)])
        if graph_tokens:
            self.q_graph = nn.Parameter(torch.randn(g, d) * 0.02)
            self.graph_attn = nn.MultiheadAttention(d, spec.heads, batch_first=True)
            self.w_g = nn.Linear(d, d)
            self.graph_head = nn.Linear(d, variables * variables)    # M3S global level
        self.proj = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d))   # -> LLM embedding space
        self.desc_proj = nn.Linear(d, d)                              # InfoNCE node side
        self.state_head = nn.Linear(d, 2 * levels)                    # [ours] node levels
        self.decoder_ramp = bool(decoder_ramp and node_tokens and spec.decoder_layers)
        if self.decoder_ramp:
            self._decoder_weights(d, len(spec.decoder_layers))

    def _decoder_weights(self, d: int, n: int) -> None:
        """The in-decoder RAMP weights, drawn on a fork of the RNG: every other weight of the
        model (also those built after this module) is the same as its input-concat twin's."""
        with torch.random.fork_rng(devices=[]):
            self.dec_w_dn = nn.ParameterList([nn.Parameter(torch.randn(d, d) / math.sqrt(d))
                                              for _ in range(n)])
            self.dec_w_up = nn.ParameterList([nn.Parameter(torch.randn(d, d) / math.sqrt(d))
                                              for _ in range(n)])
            self.dec_mlp = nn.ModuleList([nn.Sequential(nn.LayerNorm(3 * d), nn.Linear(3 * d, d),
                                                        nn.GELU(), nn.Linear(d, d))
                                          for _ in range(n)])
            for mlp in self.dec_mlp:      # [ours] starts as a no-op: the input-concat model
                nn.init.zeros_(mlp[-1].weight)
                nn.init.zeros_(mlp[-1].bias)

    @property
    def n_tokens(self) -> int:
        return (self.spec.nodes if self.node_tokens else 0) + \
            (self.spec.graph_queries if self.graph_tokens else 0)

    def forward(self, before: torch.Tensor, after: torch.Tensor) -> dict[str, torch.Tensor]:
        """before, after: (B, N, d) projected visual tokens. Returns tokens (B, n_tokens, d),
        a (B, m, m), z (B, m, d), h (B, m, d) and, with graph tokens, graph (B, g, d)."""
        b = before.shape[0]
        v = torch.cat([before + self.block[0], after + self.block[1]], dim=1)
        q = self.q_var.expand(b, -1, -1)
        z = self.var_norm(q + self.var_attn(q, v, v, need_weights=False)[0])
        z = z + self.var_ffn(z)
        m = z.shape[1]
        if self.dag:
            a = edge_matrix(z, self.p, self.r, self.spec.temperature)
        else:
            a = (1 - torch.eye(m, dtype=z.dtype, device=z.device)).expand(b, m, m)
        h, g = z, None
        for k in range(self.spec.ramp_layers):
            dn, up = ramp_messages(a, h, self.w_dn[k], self.w_up[k])
            h = h + self.ramp_mlp[k](torch.cat([h, dn, up], dim=-1))
            if self.graph_tokens:
                qg = self.q_graph.expand(b, -1, -1)
                g = self.graph_attn(qg, h, h, need_weights=False)[0]
                h = h + self.w_g(g.mean(dim=1, keepdim=True))
        if self.graph_tokens and g is None:          # K = 0: graph tokens from Z directly
            qg = self.q_graph.expand(b, -1, -1)
            g = self.graph_attn(qg, h, h, need_weights=False)[0]
        parts = ([h] if self.node_tokens else []) + ([g] if self.graph_tokens else [])
        out = {"tokens": self.proj(torch.cat(parts, dim=1)), "a": a, "z": z, "h": h}
        if g is not None:
            out["graph"] = g
        return out

    def decoder_update(self, k: int, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """The in-decoder RAMP residual after the k-th layer of `spec.decoder_layers`: x (B, m, d)
        the decoder's hidden states at the node-token positions, a (B, m, m) the same soft DAG
        the input tokens were built with (module docstring)."""
        dn, up = ramp_messages(a, x, self.dec_w_dn[k], self.dec_w_up[k])
        return x + self.dec_mlp[k](torch.cat([x, dn, up], dim=-1))


def m3s_loss(module: CausalModule, out: dict[str, torch.Tensor], *, descriptions: torch.Tensor,
             true_a: torch.Tensor, edge_mask: torch.Tensor, states: torch.Tensor,
             weights: Any, acyclic_weight: float) -> dict[str, torch.Tensor]:
    """The M3S terms for one batch (spec §2). true_a: (B, k, k) 0/1; edge_mask: (B,) 1 where the
    sample's edges are labelled; states: (B, k, 2) levels before / after; weights: a Losses
    config (edge, align, graph, node, align_temperature). Returns each weighted term: edge and
    acyclic only with a learned DAG (`module.dag`); graph whenever the module has graph tokens
    (the no-DAG ablation keeps the graph-level supervision of its graph tokens)."""
    k = module.variables
    terms: dict[str, torch.Tensor] = {}
    z = out["z"]
    terms["align"] = weights.align * info_nce(module.desc_proj(z), descriptions,
                                              weights.align_temperature)
    logits = module.state_head(out["h"][:, :k]).reshape(-1, k, 2, module.levels)
    terms["node"] = weights.node * nn.functional.cross_entropy(
        logits.reshape(-1, module.levels), states.reshape(-1))
    off = 1 - torch.eye(k, device=z.device)
    mask = edge_mask[:, None, None] * off          # labelled, off-diagonal edges
    if module.dag:                                 # no DAG: A is constant, nothing to fit
        a = out["a"][:, :k, :k]
        bce = nn.functional.binary_cross_entropy(a.clamp(1e-6, 1 - 1e-6), true_a,
                                                 reduction="none")
        terms["edge"] = weights.edge * (bce * mask).sum() / mask.sum().clamp(min=1)
        terms["acyclic"] = acyclic_weight * acyclicity(out["a"]).mean()
    if module.graph_tokens and "graph" in out:     # graph tokens exist: lambda_g, DAG or not
        gl = module.graph_head(out["graph"].mean(dim=1)).reshape(-1, k, k)
        gb = nn.functional.binary_cross_entropy_with_logits(gl, true_a, reduction="none")
        terms["graph"] = weights.graph * (gb * mask).sum() / mask.sum().clamp(min=1)
    return terms
