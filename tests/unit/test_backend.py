"""The LLM backend: the OpenAI-compatible HTTP client against a real local server
(`stages.models.serve`, a separate process started and stopped by PID) serving a tiny model
saved in the test, compared with the local Hugging Face backend on the same folder."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from stages.models.backend import (BackendConfig, LocalHFBackend, OpenAICompatibleBackend,
                                   make_backend)

KEY_ENV = "PAPERLINE_TEST_SERVE_KEY"
KEY = "sk-test-7f3a9c-not-a-real-key"
PROMPTS = ["Q: 1+2=? A:", "Q: 13+4-5=? A:", "Q: 7=? A:"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A randomly initialised tiny Llama over the char tokenizer, saved like any HF model."""
    import torch

    from stages.models import base
    from stages.models.tokenizer import build_tokenizer

    torch.manual_seed(0)
    tokenizer = build_tokenizer(set("0123456789+-=;#?:QA ").union("YesNo"))
    cfg = base.Config(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                      max_positions=64)
    model = base.build_model(cfg, tokenizer)
    folder = tmp_path_factory.mktemp("serve-model") / "tiny"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def server(tiny_model: Path):
    """The server on a free loopback port, requiring a key read from the environment."""
    env = {**os.environ, KEY_ENV: KEY, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "stages.models.serve", "--model",
                             str(tiny_model), "--port", "0", "--api-key-env", KEY_ENV],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()          # "serving tiny on http://127.0.0.1:PORT/v1"
        assert line.startswith("serving tiny on http://127.0.0.1:"), \
            line + proc.stderr.read()[-2000:] if proc.poll() is not None else line
        yield proc, line.split(" on ")[1].strip()
    finally:
        os.kill(proc.pid, 15)                   # by PID
        proc.wait(timeout=30)


def client(url: str, **kw) -> OpenAICompatibleBackend:
    cfg = BackendConfig(kind="openai", model="tiny", base_url=url, api_key_env=KEY_ENV, **kw)
    backend = make_backend(cfg)
    assert isinstance(backend, OpenAICompatibleBackend)
    return backend


def test_http_client_gets_the_local_backends_completions_at_temperature_0(server, tiny_model,
                                                                         monkeypatch):
    proc, url = server
    monkeypatch.setenv(KEY_ENV, KEY)
    local = LocalHFBackend(tiny_model)
    want = local.complete(PROMPTS, max_new_tokens=6, temperature=0.0, n=2, seed=0)
    got = client(url, batch_size=2).complete(PROMPTS, max_new_tokens=6, temperature=0.0, n=2,
                                             seed=0)   # two requests: batches of 2 and 1 prompt
    assert got == want
    assert all(len(g) == 2 and g[0].text for g in got)
    # sampled: the server's seed reaches the model, so a request repeats exactly
    a = client(url).complete(PROMPTS[:2], max_new_tokens=5, temperature=1.0, n=3, seed=7)
    b = client(url).complete(PROMPTS[:2], max_new_tokens=5, temperature=1.0, n=3, seed=7)
    assert a == b and len(a[1]) == 3


def test_key_comes_from_the_environment_and_never_from_a_command_line(server, monkeypatch):
    proc, url = server
    cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
    assert KEY not in cmdline and KEY_ENV in cmdline
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(RuntimeError, match=f"{KEY_ENV}.*not set"):
        client(url).complete(PROMPTS[:1], max_new_tokens=2)
    monkeypatch.setenv(KEY_ENV, "sk-wrong")
    with pytest.raises(RuntimeError, match="HTTP 401"):
        client(url).complete(PROMPTS[:1], max_new_tokens=2)
    with pytest.raises(ValidationError, match="environment variable name"):
        BackendConfig(kind="openai", model="tiny", base_url=url, api_key_env="sk-abc 123")


def test_bad_base_url_is_a_clear_error(server, monkeypatch):
    proc, url = server
    monkeypatch.setenv(KEY_ENV, KEY)
    with pytest.raises(ValidationError, match="base_url"):
        BackendConfig(kind="openai", model="tiny", base_url="127.0.0.1:8000/v1")
    with pytest.raises(ValidationError, match="needs backend.base_url"):
        BackendConfig(kind="openai", model="tiny")
    with pytest.raises(RuntimeError, match="HTTP 404"):   # a server, but not the API root
        client(url.rsplit("/v1", 1)[0] + "/api").complete(PROMPTS[:1], max_new_tokens=2)
    with socket.socket() as s:                             # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    started = time.perf_counter()
    with pytest.raises(RuntimeError, match=f"127.0.0.1:{closed}/v1/completions unreachable "
                                           "after 2 tries"):
        client(f"http://127.0.0.1:{closed}/v1", max_retries=1).complete(PROMPTS[:1],
                                                                        max_new_tokens=2)
    assert time.perf_counter() - started < 5
    with pytest.raises(RuntimeError, match="HTTP 400.*prompt"):
        client(url)._post({"model": "tiny", "prompt": [], "max_tokens": 2})
    with pytest.raises(RuntimeError, match="HTTP 400.*not served"):
        client(url)._post({"model": "other", "prompt": "x", "max_tokens": 2})
    assert proc.poll() is None                             # bad requests never kill the server
