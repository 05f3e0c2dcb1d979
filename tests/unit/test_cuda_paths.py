"""GPU workers: a model loaded where torch sees a CUDA GPU runs there, and every hand-written
forward pass feeds it batches on its device, giving the CPU's numbers.

Runs only where a CUDA GPU is visible (a GPU worker, DESIGN "scale-out"); the 2-core machines
and CI have none, so there the module is skipped. Each test computes the same thing on the CPU
(`PAPERLINE_DEVICE=cpu`) and on the GPU and compares: a stage that left a batch on the CPU
would raise a device-mismatch error here.
"""

from __future__ import annotations

import pytest
import torch

from stages.models import base
from stages.models.generate import default_device, generate, load_model
from tests.unit.test_generate import ANSWER, PROMPTS, train_ok_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny " ok" model of test_generate, trained by the HF Trainer (on the GPU here)."""
    out = tmp_path_factory.mktemp("cuda-model")
    model = train_ok_model(out)
    assert next(model.parameters()).device.type == "cuda"   # the Trainer used the GPU
    return out


@pytest.fixture(autouse=True)
def exact_matmuls():
    """fp32 matmuls without TF32, so CPU and GPU agree to float rounding."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def both(monkeypatch, fn):
    """fn() on the CPU, then on the GPU (the default where one is visible)."""
    monkeypatch.setenv("PAPERLINE_DEVICE", "cpu")
    on_cpu = fn()
    monkeypatch.delenv("PAPERLINE_DEVICE")
    return on_cpu, fn()


def test_models_load_onto_the_gpu_unless_told_otherwise(folder, monkeypatch):
    monkeypatch.delenv("PAPERLINE_DEVICE", raising=False)
    assert default_device() == "cuda"
    model, _ = load_model(folder)
    assert model.device.type == "cuda"
    monkeypatch.setenv("PAPERLINE_DEVICE", "cpu")
    assert load_model(folder)[0].device.type == "cpu"


def test_generation_and_the_local_backend_match_the_cpu(folder, monkeypatch):
    from stages.models.backend import LocalHFBackend

    def greedy():
        model, tok = load_model(folder)
        return generate(model, tok, PROMPTS, max_new_tokens=12, batch_size=2)

    cpu, gpu = both(monkeypatch, greedy)
    assert gpu == cpu == [[ANSWER]] * len(PROMPTS)

    def sampled():
        backend = LocalHFBackend(folder, batch_size=8)
        assert backend.model.device.type in ("cpu", "cuda")
        return [[c.text for c in outs] for outs in
                backend.complete(PROMPTS, max_new_tokens=6, temperature=1.0, n=3, seed=1)]

    cpu, gpu = both(monkeypatch, sampled)
    assert len(gpu) == len(PROMPTS) and all(len(s) == 3 for s in gpu)


def test_hand_written_forward_passes_give_the_cpu_numbers(folder, monkeypatch):
    from stages.edco.edco import target_nll
    from stages.trace.score import sequence_nll

    targets = [ANSWER, " 3", ANSWER + "!", " 29", ANSWER]

    def losses():
        model, tok = load_model(folder)
        rows = base.encode_sft_rows(tok, PROMPTS, targets, max_len=64)
        return ([base.completion_loss(model, rows, tok.pad_token_id, batch_size=2)]
                + sequence_nll(model, tok, PROMPTS, targets, batch_size=2)
                + target_nll(model, tok, PROMPTS, targets, batch_size=2))

    cpu, gpu = both(monkeypatch, losses)
    assert gpu == pytest.approx(cpu, rel=1e-4, abs=1e-5)


def test_router_features_from_hidden_states_match_the_cpu(folder, monkeypatch):
    from stages.racer.features import hidden_embed

    cpu, gpu = both(monkeypatch, lambda: hidden_embed(PROMPTS, folder, batch_size=2))
    assert gpu.shape == cpu.shape == (len(PROMPTS), 32)
    assert gpu == pytest.approx(cpu, rel=1e-4, abs=1e-5)


def test_prm_scores_and_a_training_step_run_on_the_gpu(folder, monkeypatch):
    from stages.train import prm

    def probs():
        torch.manual_seed(0)   # the fresh classification head
        model, tok = prm.load_prm(folder, new_head=True)
        sep = tok.convert_tokens_to_ids("#")
        enc = [prm.encode_prm(tok, p, ["1+2=3", "3+1=4"], [True, False], sep) for p in PROMPTS]
        out = prm.step_probs(model, enc, tok.pad_token_id, batch_size=2)
        if model.device.type == "cuda":   # one optimizer step of the stage's own loop shape
            batch = prm.collate(enc, tok.pad_token_id)
            loss = model(**{k: v.to(model.device) for k, v in batch.items()}).loss
            loss.backward()
            assert all(p.grad is None or p.grad.device.type == "cuda"
                       for p in model.parameters())
        return [p for ps in out for p in ps]

    cpu, gpu = both(monkeypatch, probs)
    assert len(cpu) == 2 * len(PROMPTS)
    assert gpu == pytest.approx(cpu, rel=1e-4, abs=1e-5)
