"""SAME (Xie et al., ICML 2026, arXiv 2602.01990): stabilised MoE-LoRA for continual instruction
tuning, in one module. The method in three lines:

- LoRA experts on the decoder FFN with one router per layer, `h = W0 x + sum_i w_i B_i A_i x`,
  `w = softmax(W_G x)` (spec §2, paper form; the code's cross-expert form is `cross_terms`);
- the router's gradient is split on the spectrum of the old tasks' inputs: inside their
  top-energy subspace it is scaled (or removed), outside it passes (`spectral_router_grad`,
  spec §2a); each expert's LoRA-A gradient is preconditioned by the damped inverse of the old
  inputs' curvature (`curvature_precondition`, §2b, mu = 0.9, delta = 0.9);
- experts that are little used but important to old inputs are frozen (`freeze_rule`, §2c,
  EMA 0.95, tau = 0.1; the expert of the current task never).

Where this departs from the paper / official code (Prism `PEFT/tuners/custom/same.py`) and why:
- the bases come from the accumulated second moment of the previous tasks' inputs (paper,
  `update_moment`), not from the current batch by a randomised range finder (code): the
  current batch's basis does not know the old inputs, so it cannot keep their routing; d = 128
  makes an exact eigendecomposition cheap. Not centred (`centre` False): routing `W_G x` of an
  old input depends on its mean direction too;
- `router_mode: project` (default here) sets the in-subspace scale to 0, the orthogonal-subspace
  update of the issue (old routing exactly kept when the subspace holds all old energy), and
  projects the optimiser's update as well as the gradient (`project_router_update`: AdamW's
  per-coordinate scaling and weight decay would otherwise move the old routing);
  `scaled` is the code's clamp((1/s)/max(1/s), 1 -+ 0.2) on the sliding-averaged spectrum;
- sigma is a standard deviation (sqrt of an eigenvalue) as in the code, not a variance;
- inference routing is dense (no top-2) and uses every expert; by default (`freeze_mode:
  gradient`) a frozen expert keeps its routing weight while training and only gets no update:
  masked out of the routing (`mask`, the code), the unfrozen expert's weight is renormalised to
  1 while training and falls back to ~1/E under dense inference, which undid what it learned
  (task 1 accuracy 0.0 right after task 1 in a development run; README).

Run: `paperline repro same` (pipelines/same/README.md).
"""

from __future__ import annotations

import math
from typing import Literal, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn


class Adapter(BaseModel):
    """One arm's adapter and which of SAME's three fixes are on."""

    model_config = ConfigDict(extra="forbid")

    experts: int = Field(5, ge=1, le=64, description="LoRA experts per layer (code: = tasks)")
    rank: int = Field(4, ge=1, le=256, description="rank of each expert")
    alpha_ratio: float = Field(2.0, gt=0, le=64, description="lora_alpha / rank (code 128/64)")
    dropout: float = Field(0.05, ge=0, lt=1, description="LoRA dropout on the input (code)")
    a_std: float = Field(0.01, gt=0, le=1, description="init std of LoRA-A (code: 0.01; B = 0)")
    routing: Literal["token", "batch"] = Field(
        "token", description="token: w per token (paper); batch: mean over the batch (code)")
    cross_terms: bool = Field(False, description="code form sum_i w_i B_i (sum_j w_j A_j x)")
    spectral_router: bool = Field(False, description="§2a: spectral router gradient")
    curvature: bool = Field(False, description="§2b: curvature-preconditioned LoRA-A gradients")
    freezing: bool = Field(False, description="§2c: adaptive expert freezing")


class Method(BaseModel):
    """SAME's constants (code defaults, spec §2) shared by every arm that uses them."""

    model_config = ConfigDict(extra="forbid")

    delta: float = Field(0.9, gt=0, le=1, description="energy kept in the old subspace (code)")
    mu: float = Field(0.9, gt=0, le=100, description="curvature damping (code)")
    router_mode: Literal["project", "scaled"] = Field(
        "project", description="in-subspace router scale: 0 (project) or the code's clamp")
    router_scaling_factor: float = Field(0.2, ge=0, le=1,
                                         description="scaled: clamp to 1 -+ this (code 0.2)")
    smooth_window: int = Field(3, ge=1, le=64, description="sliding mean of sigma (code 3)")
    ema: float = Field(0.95, gt=0, lt=1, description="decay of the usage / importance EMAs")
    tau: float = Field(0.1, ge=-1, le=1, description="freeze when score < tau (code 0.1)")
    centre: bool = Field(False, description="centre the inputs before the moment (code: yes)")
    freeze_mode: Literal["gradient", "mask"] = Field(
        "gradient", description="frozen experts: no update but still routed (gradient), or "
                                "also masked out of the routing while training (mask, code)")


# --- the math: small pure functions --------------------------------------------------------

def update_moment(moment: torch.Tensor | None, count: int, batch_sum: torch.Tensor,
                  batch_count: int) -> tuple[torch.Tensor, int]:
    """Running second moment `C^t = (alpha_{t-1} C^{t-1} + n_t C_hat^t) / alpha_t` (spec §2a),
    alpha counting samples; `batch_sum` is sum_x x x^T over the n_t new samples."""
    total = count + batch_count
    if total == 0:
        raise ValueError("update_moment: no samples")
    if moment is None:
        return batch_sum / total, total
    return (count * moment + batch_sum) / total, total


def spectrum(moment: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(V, sigma): eigenvectors as columns, by descending eigenvalue, and sigma = sqrt(eigenvalue)
    (a standard deviation, as the code's S)."""
    evals, evecs = torch.linalg.eigh(moment.double())
    order = torch.argsort(evals, descending=True)
    return evecs[:, order].to(moment.dtype), evals[order].clamp_min(0).sqrt().to(moment.dtype)


def energy_rank(sigma: torch.Tensor, delta: float) -> int:
    """Smallest k with sum_{i<=k} sigma_i^2 / sum sigma^2 >= delta (spec §2a)."""
    energy = sigma.double() ** 2
    total = float(energy.sum())
    if total <= 0:
        return 0
    cum = torch.cumsum(energy, 0) / total
    return int(torch.searchsorted(cum, torch.tensor(delta - 1e-12, dtype=cum.dtype))) + 1


def smooth(sigma: torch.Tensor, window: int) -> torch.Tensor:
    """Mean over a window of `window` values ending at i (code: S_smooth, window 3)."""
    c = torch.cumsum(torch.cat([sigma.new_zeros(1), sigma]), 0)
    i = torch.arange(1, len(sigma) + 1)
    lo = (i - window).clamp_min(0)
    return (c[i] - c[lo]) / (i - lo).to(sigma.dtype)


def router_scale(sigma_k: torch.Tensor, factor: float, window: int = 3) -> torch.Tensor:
    """scale_i = clamp((1/s_i) / max_j (1/s_j), 1 - factor, 1 + factor), s the smoothed spectrum
    (code, router_scaling_factor 0.2): directions of large old variance move less."""
    inv = 1.0 / smooth(sigma_k, window).clamp_min(1e-12)
    return (inv / inv.max()).clamp(1 - factor, 1 + factor)


def spectral_router_grad(grad: torch.Tensor, basis: torch.Tensor, scale: torch.Tensor
                         ) -> torch.Tensor:
    """grad (E, d) <- (grad V_k) diag(scale) V_k^T + grad (I - V_k V_k^T) (spec §2a), V_k = basis
    (d, k). scale = 0: the orthogonal-subspace projection (old inputs' routing unchanged)."""
    inside = grad @ basis
    return (inside * scale) @ basis.T + grad - inside @ basis.T


def curvature_precondition(grad: torch.Tensor, basis: torch.Tensor, sigma_k: torch.Tensor,
                           mu: float) -> torch.Tensor:
    """grad (..., d_in) <- grad [V_k diag(1/(s_k + mu)) V_k^T + (1/mu)(I - V_k V_k^T)] (spec
    §2b, the damped inverse of the old inputs' curvature; code: on LoRA-A, mu = 0.9)."""
    inside = grad @ basis
    return (inside / (sigma_k + mu)) @ basis.T + (grad - inside @ basis.T) / mu


def minmax(x: torch.Tensor) -> torch.Tensor:
    """(x - min) / (max - min); all zeros when x is constant."""
    span = x.max() - x.min()
    return torch.zeros_like(x) if span <= 0 else (x - x.min()) / span


def freeze_rule(usage: torch.Tensor, importance: torch.Tensor, tau: float, keep: int
                ) -> torch.Tensor:
    """Frozen experts (bool, E): score = minmax(usage) - minmax(importance) < tau, except the
    expert `keep` (the current task's) (spec §2c)."""
    frozen = (minmax(usage) - minmax(importance)) < tau
    frozen[keep] = False
    return frozen


def js_divergence(p: Sequence[float], q: Sequence[float]) -> float:
    """Jensen-Shannon divergence in bits (0..1) of two distributions (normalised first)."""
    ps, qs = sum(p), sum(q)
    if ps <= 0 or qs <= 0:
        return math.nan
    p = [x / ps for x in p]
    q = [x / qs for x in q]
    m = [(a + b) / 2 for a, b in zip(p, q)]

    def kl(a: list[float], b: list[float]) -> float:
        return sum(x * math.log2(x / y) for x, y in zip(a, b) if x > 0)
    return 0.5 * kl(p, m) + 0.5 * kl(q, m)


def average_accuracy(acc: Sequence[Sequence[float]]) -> float:
    """Final average accuracy: mean_j a_{T,j} (a[i][j]: accuracy on task j after task i)."""
    return sum(acc[-1]) / len(acc[-1])


def bwt(acc: Sequence[Sequence[float]]) -> float:
    """Backward transfer (1/(T-1)) sum_{j<T} (a_{T,j} - a_{j,j}) (spec §4); < 0 is forgetting."""
    t = len(acc)
    if t < 2:
        return math.nan
    return sum(acc[-1][j] - acc[j][j] for j in range(t - 1)) / (t - 1)


# --- MoE-LoRA on a Llama FFN -------------------------------------------------------------------

class MoELoRAMLP(nn.Module):
    """A frozen LlamaMLP plus `experts` LoRA experts on gate/up/down and one router (spec §2):
    gate = W_g x + s sum_i w_i B_i A_i x (same for up), down on the intermediate act(gate) * up.
    With one expert it is plain LoRA (w = 1). `mask` (E) zeroes frozen experts' weights."""

    PROJ = ("gate", "up", "down")

    def __init__(self, mlp: nn.Module, adapter: Adapter, generator: torch.Generator,
                 router_std: float = 0.02):
        super().__init__()
        self.mlp = mlp
        for p in self.mlp.parameters():
            p.requires_grad_(False)
        d, inter = mlp.gate_proj.in_features, mlp.gate_proj.out_features
        e, r = adapter.experts, adapter.rank
        self.adapter, self.scale = adapter, adapter.alpha_ratio
        dims = {"gate": (d, inter), "up": (d, inter), "down": (inter, d)}
        for name, (fan_in, fan_out) in dims.items():      # A ~ N(0, a_std), B = 0 (code)
            setattr(self, f"A_{name}", nn.Parameter(torch.randn(e, r, fan_in,
                                                                generator=generator) * adapter.a_std))
            setattr(self, f"B_{name}", nn.Parameter(torch.zeros(e, fan_out, r)))
        self.router = nn.Parameter(torch.randn(e, d, generator=generator) * router_std)
        self.register_buffer("mask", torch.ones(e))       # 0 = frozen expert
        self.route_mask = True          # False: the mask blocks updates only, not routing
        self.drop = nn.Dropout(adapter.dropout)
        self.record = False
        self.seen: dict[str, torch.Tensor] = {}

    def weights(self, x: torch.Tensor) -> torch.Tensor:
        """Routing weights (B, T, E) of FFN inputs x (B, T, d), masked and renormalised."""
        w = torch.softmax(x @ self.router.T, dim=-1)
        if self.adapter.routing == "batch":
            w = w.mean(dim=(0, 1), keepdim=True).expand_as(w)
        if not self.route_mask:
            return w
        w = w * self.mask
        return w / w.sum(-1, keepdim=True).clamp_min(1e-12)

    def lora(self, x: torch.Tensor, w: torch.Tensor, name: str) -> torch.Tensor:
        """s sum_i w_i B_i A_i x as two matmuls over the experts stacked (E*r wide)."""
        a, b = getattr(self, f"A_{name}"), getattr(self, f"B_{name}")
        e, r, fan_in = a.shape
        h = (self.drop(x) @ a.reshape(e * r, fan_in).T).unflatten(-1, (e, r))  # (B, T, E, r)
        if self.adapter.cross_terms:          # code form: sum_i w_i B_i (sum_j w_j A_j x)
            h = (h * w[..., None]).sum(-2, keepdim=True).expand_as(h)
        h = (h * w[..., None]).flatten(-2)                                   # (B, T, E*r)
        return self.scale * (h @ b.permute(0, 2, 1).reshape(e * r, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weights(x)
        gate = self.mlp.gate_proj(x) + self.lora(x, w, "gate")
        up = self.mlp.up_proj(x) + self.lora(x, w, "up")
        inter = self.mlp.act_fn(gate) * up
        if self.record:                    # what the covariance and freezing statistics need
            self.seen = {"x": x.detach(), "inter": inter.detach(), "w": w.detach()}
        return self.mlp.down_proj(inter) + self.lora(inter, w, "down")

    def expert_params(self) -> list[nn.Parameter]:
        return [getattr(self, f"{k}_{n}") for n in self.PROJ for k in ("A", "B")]


def attach(language_model: nn.Module, adapter: Adapter, seed: int) -> list[MoELoRAMLP]:
    """Wrap every decoder layer's MLP (the originals stay inside; `detach` puts them back)."""
    g = torch.Generator().manual_seed(seed)
    wrapped = []
    for layer in language_model.layers:
        mlp = layer.mlp.mlp if isinstance(layer.mlp, MoELoRAMLP) else layer.mlp
        layer.mlp = MoELoRAMLP(mlp, adapter, g)
        wrapped.append(layer.mlp)
    return wrapped


def detach(language_model: nn.Module) -> None:
    for layer in language_model.layers:
        if isinstance(layer.mlp, MoELoRAMLP):
            layer.mlp = layer.mlp.mlp


class History:
    """One layer's running second moments of the old tasks' FFN inputs (x for the router and
    gate/up experts, the intermediate for down) and the bases taken from them at task start."""

    def __init__(self) -> None:
        self.moment: dict[str, torch.Tensor | None] = {"x": None, "inter": None}
        self.count = {"x": 0, "inter": 0}
        self.pending: dict[str, torch.Tensor | None] = {"x": None, "inter": None}
        self.pending_n = {"x": 0, "inter": 0}
        self.basis: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}

    def observe(self, seen: dict[str, torch.Tensor], centre: bool) -> None:
        for key in ("x", "inter"):
            x = seen[key].reshape(-1, seen[key].shape[-1])
            if centre:
                x = x - x.mean(0, keepdim=True)
            s = (x.T @ x).double().cpu()
            self.pending[key] = s if self.pending[key] is None else self.pending[key] + s
            self.pending_n[key] += x.shape[0]

    def end_task(self, delta: float) -> None:
        """Fold this task's inputs into the moments; the bases for the next task."""
        for key in ("x", "inter"):
            if self.pending[key] is None:
                continue
            self.moment[key], self.count[key] = update_moment(
                self.moment[key], self.count[key], self.pending[key], self.pending_n[key])
            self.pending[key], self.pending_n[key] = None, 0
            v, sigma = spectrum(self.moment[key])
            self.basis[key] = (v.float(), sigma.float(), energy_rank(sigma, delta))


def apply_gradients(layer: MoELoRAMLP, hist: History, method: Method) -> None:
    """SAME's gradient edits on one layer (after backward, before the optimiser step)."""
    ad = layer.adapter
    if ad.spectral_router and "x" in hist.basis and layer.router.grad is not None:
        v, sigma, k = hist.basis["x"]
        if k > 0:
            g = layer.router.grad
            scale = (torch.zeros(k) if method.router_mode == "project"
                     else router_scale(sigma[:k], method.router_scaling_factor,
                                       method.smooth_window))
            layer.router.grad = spectral_router_grad(g, v[:, :k].to(g), scale.to(g))
    if ad.curvature:
        for name in MoELoRAMLP.PROJ:
            key = "inter" if name == "down" else "x"
            a = getattr(layer, f"A_{name}")
            if key in hist.basis and a.grad is not None:
                v, sigma, k = hist.basis[key]
                a.grad = curvature_precondition(a.grad, v[:, :k].to(a.grad),
                                                sigma[:k].to(a.grad), method.mu)


def project_router_update(layer: MoELoRAMLP, before: torch.Tensor, hist: History,
                          method: Method) -> None:
    """`router_mode: project`, after the optimiser step: W <- W_prev + dW (I - V_k V_k^T).

    Projecting the gradient (`apply_gradients`) is enough for SGD, whose update is the gradient;
    AdamW divides each coordinate by its own second moment and decays every weight, so its
    update leaves the orthogonal complement (measured: old-input routing logits moved by 0.22
    over 20 steps, 3.7e-7 with SGD). Projecting the update itself keeps the old inputs' routing
    whatever the optimiser. `scaled` (the code's mode) edits the gradient only, as the code."""
    if not (layer.adapter.spectral_router and method.router_mode == "project"
            and "x" in hist.basis):
        return
    v, _, k = hist.basis["x"]
    if k == 0:
        return
    with torch.no_grad():
        delta = layer.router - before
        layer.router.copy_(before + spectral_router_grad(delta, v[:, :k].to(delta),
                                                         torch.zeros(k).to(delta)))


class Freezer:
    """Adaptive expert activation for one layer (spec §2c): EMAs of usage U(i) = w_i and
    importance F(i) = w_i ||x||^2, masks from `freeze_rule`, reset at each task."""

    def __init__(self, experts: int, method: Method):
        self.e, self.method = experts, method
        self.reset(0)

    def reset(self, task: int) -> None:
        self.task = task % self.e
        self.usage = torch.zeros(self.e)
        self.importance = torch.zeros(self.e)
        self.steps = 0
        self.frozen = torch.zeros(self.e, dtype=torch.bool)
        self.done = False

    def step(self, seen: dict[str, torch.Tensor]) -> torch.Tensor:
        """Update the EMAs from one batch; returns the frozen set (bool, E)."""
        if self.done:
            return self.frozen
        w = seen["w"].reshape(-1, self.e).float().cpu()
        norms = seen["x"].reshape(w.shape[0], -1).float().pow(2).sum(-1).cpu()
        u, f = w.mean(0), (w * norms[:, None]).mean(0)
        b = self.method.ema
        self.usage = u if self.steps == 0 else b * self.usage + (1 - b) * u
        self.importance = f if self.steps == 0 else b * self.importance + (1 - b) * f
        self.steps += 1
        self.frozen = freeze_rule(self.usage, self.importance, self.method.tau, self.task)
        if int(self.frozen.sum()) == self.e - 1:     # all others frozen: masks stop updating
            self.done = True
        return self.frozen


def adapter_state(layers: Sequence[MoELoRAMLP]) -> dict[str, torch.Tensor]:
    """Every adapter tensor by a stable name (safetensors)."""
    out = {}
    for i, layer in enumerate(layers):
        for name in MoELoRAMLP.PROJ:
            for k in ("A", "B"):
                out[f"layers.{i}.{k}_{name}"] = getattr(layer, f"{k}_{name}").detach().clone()
        out[f"layers.{i}.router"] = layer.router.detach().clone()
    return out


def trainable(layers: Sequence[MoELoRAMLP]) -> list[nn.Parameter]:
    ps: list[nn.Parameter] = []
    for layer in layers:
        ps += layer.expert_params()
        if layer.adapter.experts > 1:
            ps.append(layer.router)
    return ps


def routing_usage(layers: Sequence[MoELoRAMLP]) -> list[list[float]]:
    """Mean routing weight per expert of the last recorded batch, per layer."""
    return [l.seen["w"].reshape(-1, l.adapter.experts).mean(0).tolist() for l in layers]


def set_recording(layers: Sequence[MoELoRAMLP], on: bool) -> None:
    for layer in layers:
        layer.record = on
        if not on:
            layer.seen = {}


def lora_reference(x: torch.Tensor, w0: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Plain LoRA W0 x + s B A x (the reference the one-expert MoE must equal)."""
    return x @ w0.T + scale * (x @ a.T) @ b.T

