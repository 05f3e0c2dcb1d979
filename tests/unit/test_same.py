"""SAME's math on hand-computed values (stages/same/same.py), the task family's exact answers
(stages/tasks/shapes_tasks.py) and the checks that run before compute."""

from __future__ import annotations

import math

import polars as pl
import pytest
import torch

from stages.same import same


def test_energy_rank_smallest_k_reaching_delta():
    sigma = torch.tensor([3.0, 2.0, 1.0])            # energies 9, 4, 1 of 14
    assert same.energy_rank(sigma, 0.6) == 1         # 9/14 = 0.643
    assert same.energy_rank(sigma, 0.9) == 2         # 13/14 = 0.929
    assert same.energy_rank(sigma, 0.95) == 3
    assert same.energy_rank(sigma, 1.0) == 3


def test_smooth_and_router_scale():
    assert same.smooth(torch.tensor([1.0, 2.0, 3.0, 4.0]), 3).tolist() == [1.0, 1.5, 2.0, 3.0]
    # inverse [1, .5, .25], / max -> [1, .5, .25], clamped to [0.8, 1.2]
    s = same.router_scale(torch.tensor([1.0, 2.0, 4.0]), 0.2, window=1)
    assert s.tolist() == pytest.approx([1.0, 0.8, 0.8])


def test_spectral_router_grad_hand_value():
    grad = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    e1 = torch.tensor([[1.0], [0.0], [0.0], [0.0]])
    out = same.spectral_router_grad(grad, e1, torch.tensor([0.5]))
    assert out.tolist() == [[0.5, 2.0, 3.0, 4.0]]
    assert same.spectral_router_grad(grad, e1, torch.tensor([0.0])).tolist() == \
        [[0.0, 2.0, 3.0, 4.0]]


def test_curvature_precondition_hand_value():
    grad = torch.tensor([[1.0, 1.0]])
    e1 = torch.tensor([[1.0], [0.0]])
    out = same.curvature_precondition(grad, e1, torch.tensor([0.1]), mu=0.9)
    assert out[0].tolist() == pytest.approx([1.0 / (0.1 + 0.9), 1.0 / 0.9])


def test_update_moment_counts_samples():
    m, n = same.update_moment(None, 0, torch.tensor([[2.0]]), 2)
    assert (m.item(), n) == (1.0, 2)
    m, n = same.update_moment(m, n, torch.tensor([[8.0]]), 2)
    assert (m.item(), n) == (2.5, 4)                 # (2 * 1 + 8) / 4


def test_freeze_rule_on_a_hand_made_usage_table():
    usage = torch.tensor([0.4, 0.3, 0.2, 0.1])       # minmax [1, 2/3, 1/3, 0]
    importance = torch.tensor([0.1, 0.4, 0.2, 0.3])  # minmax [0, 1, 1/3, 2/3]
    # score [1, -1/3, 0, -2/3] < 0.1 -> experts 1, 2, 3; 3 is the current task's: kept
    assert same.freeze_rule(usage, importance, 0.1, keep=3).tolist() == [False, True, True,
                                                                          False]
    assert same.freeze_rule(usage, importance, -0.5, keep=0).tolist() == [False, False, False,
                                                                           True]


def test_js_divergence_bits():
    assert same.js_divergence([1, 0], [0, 1]) == pytest.approx(1.0)
    assert same.js_divergence([0.2, 0.8], [0.2, 0.8]) == pytest.approx(0.0)
    kl_p = 0.5 * math.log2(0.5 / 0.75) + 0.5 * math.log2(0.5 / 0.25)
    kl_q = math.log2(1 / 0.75)
    assert same.js_divergence([0.5, 0.5], [1, 0]) == pytest.approx(0.5 * (kl_p + kl_q))


def test_bwt_and_average_accuracy():
    acc = [[0.9, 0.1], [0.5, 0.8]]
    assert same.bwt(acc) == pytest.approx(-0.4)
    assert same.average_accuracy(acc) == pytest.approx(0.65)
    assert math.isnan(same.bwt([[0.7]]))


class _LlamaMLP(torch.nn.Module):
    """The shape of transformers' LlamaMLP (gate/up/down, SiLU), without importing it."""

    def __init__(self, d: int, inter: int):
        super().__init__()
        self.gate_proj = torch.nn.Linear(d, inter, bias=False)
        self.up_proj = torch.nn.Linear(d, inter, bias=False)
        self.down_proj = torch.nn.Linear(inter, d, bias=False)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _mlp(d: int = 8, inter: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    return _LlamaMLP(d, inter)


def test_moe_lora_with_one_expert_equals_lora():
    mlp = _mlp()
    layer = same.MoELoRAMLP(mlp, same.Adapter(experts=1, rank=2, dropout=0.0),
                            torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name in layer.PROJ:
            getattr(layer, f"B_{name}").normal_(generator=g)
    x = torch.randn(2, 3, 8, generator=g)
    s = layer.scale

    def lora(inp: torch.Tensor, name: str) -> torch.Tensor:
        w0 = getattr(mlp, f"{name}_proj").weight
        a, b = getattr(layer, f"A_{name}")[0], getattr(layer, f"B_{name}")[0]
        return same.lora_reference(inp, w0, a, b, s)

    inter = mlp.act_fn(lora(x, "gate")) * lora(x, "up")
    assert torch.allclose(layer(x), lora(inter, "down"), atol=1e-6)
    # and the LoRA moved the output (B != 0): the test can fail
    assert not torch.allclose(layer(x), mlp(x), atol=1e-3)


def test_projected_router_update_keeps_old_routing():
    """Old inputs in a 3-d subspace of d = 8: after SGD steps with the projected router
    gradient (router_mode project, basis from the old inputs' moment) their routing weights are
    unchanged to within 1e-6, while a new input's routing moves."""
    mlp = _mlp()
    layer = same.MoELoRAMLP(mlp, same.Adapter(experts=5, rank=2, dropout=0.0,
                                              spectral_router=True),
                            torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(3)
    basis = torch.linalg.qr(torch.randn(8, 3, generator=g))[0]
    old = (torch.randn(1, 40, 3, generator=g) @ basis.T)            # (1, 40, 8) in the span
    hist = same.History()
    layer.record = True
    layer(old)
    hist.observe(layer.seen, centre=False)
    hist.end_task(delta=0.999999)
    assert hist.basis["x"][2] == 3
    before = layer.weights(old).detach().clone()
    new = torch.randn(1, 10, 8, generator=g)
    new_before = layer.weights(new).detach().clone()
    method = same.Method(router_mode="project")
    for _ in range(5):
        layer.zero_grad()
        layer.weights(new)[..., 0].sum().backward()
        same.apply_gradients(layer, hist, method)
        with torch.no_grad():
            layer.router -= 1.0 * layer.router.grad
    assert torch.allclose(layer.weights(old), before, atol=1e-6)
    assert not torch.allclose(layer.weights(new), new_before, atol=1e-3)
    # without the projection the old routing moves (the check can fail)
    layer.router.grad = None
    layer.weights(new)[..., 0].sum().backward()
    with torch.no_grad():
        layer.router -= layer.router.grad
    assert not torch.allclose(layer.weights(old), before, atol=1e-4)


def test_projected_router_update_keeps_old_routing_under_adamw():
    """AdamW (per-coordinate scaling, weight decay) leaves the subspace that the projected
    gradient lies in; the projected update keeps old routing to 1e-6 (the check can fail:
    without `project_router_update` the old routing moves)."""
    def run(project: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        mlp = _mlp()
        layer = same.MoELoRAMLP(mlp, same.Adapter(experts=5, rank=2, dropout=0.0,
                                                  spectral_router=True),
                                torch.Generator().manual_seed(1))
        g = torch.Generator().manual_seed(3)
        basis = torch.linalg.qr(torch.randn(8, 3, generator=g))[0]
        old = (torch.randn(1, 40, 3, generator=g) @ basis.T)
        hist = same.History()
        layer.record = True
        layer(old)
        hist.observe(layer.seen, centre=False)
        hist.end_task(delta=0.999999)
        before = layer.weights(old).detach().clone()
        new = torch.randn(1, 10, 8, generator=g)
        new_before = layer.weights(new).detach().clone()
        method = same.Method(router_mode="project")
        opt = torch.optim.AdamW([layer.router], lr=0.05, weight_decay=0.1)
        for _ in range(20):
            opt.zero_grad()
            layer.weights(new)[..., 0].sum().backward()
            same.apply_gradients(layer, hist, method)
            prev = layer.router.detach().clone()
            opt.step()
            if project:
                same.project_router_update(layer, prev, hist, method)
        return layer.weights(old).detach(), before, layer.weights(new).detach(), new_before

    old_w, before, new_w, new_before = run(project=True)
    assert torch.allclose(old_w, before, atol=1e-6)
    assert not torch.allclose(new_w, new_before, atol=1e-3)
    old_w, before, _, _ = run(project=False)
    assert not torch.allclose(old_w, before, atol=1e-4)


def test_freezer_never_freezes_the_current_task_and_stops_when_all_others_are():
    f = same.Freezer(3, same.Method(tau=0.1))
    f.reset(1)
    w = torch.tensor([[[0.6, 0.1, 0.3]]])
    x = torch.ones(1, 1, 4)
    frozen = f.step({"w": w, "x": x})
    # usage minmax [1, 0, .4]; importance = usage * 4 -> same minmax; score 0 < 0.1 for all,
    # expert 1 (the task's) kept
    assert frozen.tolist() == [True, False, True] and f.done


# --- the task family -------------------------------------------------------------------------

def test_task_answers_are_exact():
    from stages.tasks import shapes_tasks as st

    assert st.answer("colour", ["red circle"]) == "red"
    assert st.answer("shape", ["red circle"]) == "circle"
    assert st.answer("has_colour", ["red circle", "blue square"], "blue") == "yes"
    assert st.answer("has_shape", ["red circle", "blue square"], "diamond") == "no"
    assert st.answer("many", ["a x", "b y", "c z"]) == "yes"
    assert st.answer("many", ["a x", "b y"]) == "no"
    with pytest.raises(ValueError, match="one object"):
        st.answer("colour", ["red circle", "blue square"])


def test_generated_tasks_verify_and_balance():
    from stages.core.checks import DataValidationError
    from stages.tasks import shapes, shapes_tasks as st

    cfg = shapes.Config()
    for task in st.TASKS:
        rows = st.generate(cfg, task, 40, 0, "train", set())
        df = pl.DataFrame(rows, schema=st.SCHEMA)
        st.check_answers(df, task)
        assert set(df["target"]) <= set(st.answer_words(task, cfg))
        if task in ("has_colour", "has_shape", "many"):
            assert 10 <= (df["target"] == "yes").sum() <= 30
        assert df["query"].str.split(" ").list.len().n_unique() == 1
    bad = df.with_columns(pl.lit("yes").alias("target"))
    with pytest.raises(DataValidationError, match="exact answer"):
        st.check_answers(bad, "many")


def test_malformed_image_is_named_before_compute(tmp_path):
    from stages.same.train import read_split
    from stages.tasks import shapes, shapes_tasks as st
    from stages.tasks.images import ImageValidationError

    rows = st.generate(shapes.Config(), "colour", 3, 0, "test", set())
    rows[1]["image"] = rows[1]["image"][:40]                          # truncated PNG
    (tmp_path / "colour").mkdir()
    pl.DataFrame(rows, schema=st.SCHEMA).write_parquet(tmp_path / "colour" / "test.parquet")
    with pytest.raises(ImageValidationError, match="colour-test-000001"):
        read_split(tmp_path, "colour", "test", 64)


def test_train_config_rejects_orders_that_are_not_permutations():
    from pydantic import ValidationError

    from stages.same.train import Config

    with pytest.raises(ValidationError, match="not a permutation"):
        Config(orders=[["colour", "shape"], ["colour", "many"]])
    with pytest.raises(ValidationError, match="unknown tasks"):
        Config(orders=[["colour", "shapes"]])


def test_headline_counts_the_claims_not_the_gate():
    from stages.core.stats import VERDICTS
    from stages.same.compare import headline

    code = {name: k for k, name in VERDICTS.items()}
    m = {"gate/lora_bwt/verdict": float(code["reproduced"]), "gate_forgetting": 1.0,
         "claim/a/verdict": float(code["inconclusive"]),
         "claim/b/verdict": float(code["reproduced"])}
    out = headline(m)
    assert out["reproduced"] == 1.0 and out["inconclusive"] == 1.0 and out["gate"] == 1.0


def test_claims_pair_seeds_each_the_mean_of_its_orders():
    from stages.same.compare import by_seed, gate

    # two orders per seed tune the same checkpoint: one value per seed, the mean of its orders
    runs = {(0, 0): -0.20, (0, 1): -0.10, (1, 0): -0.30, (1, 1): -0.10, (2, 1): 0.05,
            (2, 0): -0.05}
    assert by_seed(runs) == pytest.approx({0: -0.15, 1: -0.20, 2: 0.0})
    g = gate(list(by_seed(runs).values()))
    assert g.n == 3 and g.diff == pytest.approx(-0.35 / 3)
