"""Check 2's real server (a separate process, started and stopped by PID): continuous batching
must not change greedy outputs, newcomers join a running batch, TTFT <= E2E, bad requests and
bad load configs are rejected by name, and the Poisson driver returns its per-request table."""

from __future__ import annotations

import copy
import json
import random
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from pydantic import ValidationError

from stages.serving.server import LoadConfig, ServerProcess, make_workload, measure_server, post


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A random tiny Llama whose greedy text depends on the prompt: the default init (std 0.02)
    answers every prompt with one repeated token, which would hide rows mixed up in the batched
    cache; std 0.3 gives varied outputs, some ending early at <eos>."""
    import torch

    from stages.models import base
    from stages.models.tokenizer import build_tokenizer

    torch.manual_seed(0)
    tokenizer = build_tokenizer(set("0123456789+-=;#?:QA "))
    cfg = base.Config(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                      max_positions=256)
    model = base.build_model(cfg, tokenizer)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    folder = tmp_path_factory.mktemp("serving-model") / "tiny"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def server(tiny_model):
    with ServerProcess(tiny_model, max_batch=8) as srv:
        yield srv
    assert srv.proc.poll() is not None                       # stopped by PID on exit


def reference(folder: Path, prompts: list[list[int]], max_new: list[int],
              stop_at_eos: list[bool]) -> list[list[int]]:
    """Plain greedy `generate`, one prompt at a time (no padding, no batching)."""
    import torch

    from stages.models.generate import load_model

    model, tokenizer = load_model(folder, device="cpu")
    out = []
    for ids, n, stop in zip(prompts, max_new, stop_at_eos):
        gc = copy.deepcopy(model.generation_config)
        # Not stopping: an eos id outside the vocabulary, never produced (None would fall back
        # to the model's own eos).
        gc.update(max_new_tokens=n, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=tokenizer.eos_token_id if stop else len(tokenizer) + 1)
        with torch.inference_mode():
            got = model.generate(torch.tensor([ids]), generation_config=gc)
        out.append(got[0, len(ids):].tolist())
    return out


def test_continuous_batching_keeps_greedy_outputs(server, tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    rnd = random.Random(0)
    texts = ["Q: " + "".join(rnd.choice("0123456789+-") for _ in range(rnd.randint(1, 30)))
             + "=? A:" for _ in range(8)]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    # Wave 1: three long requests (no early stop) keep a batch decoding while wave 2, five
    # requests that stop at <eos>, is admitted into it.
    bodies = [{"prompt_ids": p, "max_new_tokens": 150, "ignore_eos": True} for p in prompts[:3]]
    bodies += [{"prompt_ids": p, "max_new_tokens": 40} for p in prompts[3:]]
    replies: dict[int, dict] = {}

    def send(i: int) -> None:
        replies[i] = post(server.url, bodies[i], timeout_s=120)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads[:3]:
        t.start()
    deadline = time.monotonic() + 60
    while not any(it["kind"] == "decode" for it in server.iterations()):
        assert time.monotonic() < deadline, "the server never started decoding"
        time.sleep(0.002)
    for t in threads[3:]:
        t.start()
    for t in threads:
        t.join(timeout=120)

    want = reference(tiny_model, prompts, [b["max_new_tokens"] for b in bodies],
                     [not b.get("ignore_eos", False) for b in bodies])
    for i, body in enumerate(bodies):
        assert replies[i]["output_ids"] == want[i], f"request {i} differs from generate"
    assert len({tuple(r["output_ids"][:8]) for r in replies.values()}) > 4   # not one answer
    assert any(len(replies[i]["output_ids"]) < 40 for i in range(3, 8))      # some hit <eos>
    for r in replies.values():
        assert 0 <= r["queue_s"] <= r["ttft_s"] <= r["e2e_s"]
        assert r["output_len"] == len(r["output_ids"]) and r["prompt_len"] > 0
    # Newcomers were prefilled while wave 1 was decoding, and decoded in the same batch.
    log = server.iterations()
    first_decode = min(it["start"] for it in log if it["kind"] == "decode")
    wave1_done = min(replies[i]["t_done"] for i in range(3))
    assert any(it["kind"] == "prefill" and first_decode < it["start"] < wave1_done for it in log)
    assert max(it["batch"] for it in log if it["kind"] == "decode") >= 4


@pytest.mark.parametrize("body, field", [
    ({"prompt_ids": "1 2 3"}, "prompt_ids"),
    ({"prompt_ids": [1, 2, 999]}, "prompt_ids"),
    ({"prompt_ids": [1, 2], "max_new_tokens": 0}, "max_new_tokens"),
    ({"prompt_ids": [1] * 200, "max_new_tokens": 100}, "256 positions"),
    ({"prompt_ids": [1, 2], "ignore_eos": "yes"}, "ignore_eos"),
])
def test_bad_request_is_a_400_naming_the_field(server, body, field):
    req = urllib.request.Request(server.url + "/generate", data=json.dumps(body).encode(),
                                 method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 400
    assert field in json.loads(err.value.read())["error"]


def test_measure_server_returns_the_per_request_table(server, tiny_model):
    load = LoadConfig(prompt_len_min=4, prompt_len_max=12, output_len_min=2, output_len_max=6,
                      warmup_requests=1, max_batch=8)
    df = measure_server(tiny_model, rates=[20.0, 50.0], n=6, seed=3, load=load, url=server.url)
    assert df.height == 12 and sorted(set(df["rate"])) == [20.0, 50.0]
    assert {"rate", "request", "scheduled_s", "arrival_s", "prompt_len", "output_len", "ttft_s",
            "e2e_s", "queue_s", "client_e2e_s"} <= set(df.columns)
    assert (df["ttft_s"] > 0).all() and (df["ttft_s"] <= df["e2e_s"]).all()
    assert (df["e2e_s"] <= df["client_e2e_s"]).all()
    # every request produced exactly its drawn length (ignore_eos), the same ones at each rate
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    ids = [i for i in range(len(tokenizer)) if i not in set(tokenizer.all_special_ids)]
    drawn = make_workload(6, 3, load, ids)
    assert df.filter(df["rate"] == 20.0)["output_len"].to_list() == \
        [w["max_new_tokens"] for w in drawn]
    assert df.filter(df["rate"] == 20.0)["prompt_len"].to_list() == \
        df.filter(df["rate"] == 50.0)["prompt_len"].to_list()
    assert (df["arrival_s"] >= df["scheduled_s"]).all()      # sent on schedule, never early


def test_bad_load_is_rejected_before_any_server_starts(tiny_model):
    with pytest.raises(ValidationError, match="prompt_len_min = 10 > prompt_len_max = 5"):
        LoadConfig(prompt_len_min=10, prompt_len_max=5)
    with pytest.raises(ValueError, match="rates"):
        measure_server(tiny_model, rates=[], n=5, seed=0)
    with pytest.raises(ValueError, match="exceeds the model's 256 positions"):
        measure_server(tiny_model, rates=[1.0], n=5, seed=0,
                       load=LoadConfig(prompt_len_max=200, output_len_max=100))
