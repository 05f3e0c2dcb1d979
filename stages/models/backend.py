"""The LLM backend that judges, selectors and labelers call: local Hugging Face or served HTTP.

Every profile here uses the local backend on the project's tiny models; a `gpu` profile may
point the same stage at a real served model (vLLM or any OpenAI-compatible server) by params:

    backend:
      kind: local            # local | openai
      model: models/judge    # local: a save_pretrained folder; openai: the served model name
      base_url: null         # openai: e.g. http://127.0.0.1:8000/v1
      api_key_env: null      # openai: NAME of the environment variable holding the key

    llm = make_backend(BackendConfig(**params["backend"]), root=ctx.root)
    outs = llm.complete(["Q: 1+2=? A:"], max_new_tokens=32, temperature=0.0, n=1, seed=0)
    outs[0][0].text, outs[0][0].n_tokens

The key is read from the environment at call time and never stored in params, logs or
MLflow. Prompts are plain completions (no chat template): the tiny models have none, and a
served instruct model is given the same text through `/v1/completions`.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator


@dataclass(frozen=True)
class Completion:
    text: str
    n_tokens: int  # generated tokens (what a token budget counts)


class Backend(Protocol):
    name: str

    def complete(self, prompts: Sequence[str], *, max_new_tokens: int, temperature: float = 0.0,
                 n: int = 1, seed: int = 0) -> list[list[Completion]]:
        """For each prompt, `n` completions (greedy when temperature == 0)."""
        ...


class BackendConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["local", "openai"] = Field("local", description="local: a save_pretrained "
                                             "folder; openai: an OpenAI-compatible server")
    model: str = Field(..., min_length=1, description="local: folder (or a paths key where the "
                       "stage resolves one); openai: the served model name")
    base_url: str | None = Field(None, description="openai: API root, e.g. "
                                 "http://127.0.0.1:8000/v1")
    api_key_env: str | None = Field(None, description="NAME of the environment variable holding "
                                    "the key; the value never enters params")
    batch_size: int = Field(64, ge=1, le=65536, description="local: sequences generated "
                            "together; openai: prompts per request")
    timeout_s: float = Field(120.0, gt=0, description="openai: seconds per request")
    max_retries: int = Field(2, ge=0, le=20, description="openai: retries on 5xx / connection "
                             "errors (client errors are not retried)")

    @model_validator(mode="after")
    def _check(self) -> "BackendConfig":
        if self.kind == "openai" and not self.base_url:
            raise ValueError("backend.kind = openai needs backend.base_url "
                             "(e.g. http://127.0.0.1:8000/v1)")
        if self.base_url is not None and not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"backend.base_url = {self.base_url!r}: expected an http:// or "
                             "https:// URL ending in the API root, e.g. http://127.0.0.1:8000/v1")
        if self.api_key_env is not None and not self.api_key_env.replace("_", "").isalnum():
            raise ValueError(f"backend.api_key_env = {self.api_key_env!r}: must be an "
                             "environment variable name, not a key")
        return self


class LocalHFBackend:
    """A local `save_pretrained` folder through the real Hugging Face loading code."""

    def __init__(self, path: str | Path, *, batch_size: int = 64) -> None:
        from stages.models.generate import load_model

        self.name = f"local:{Path(path).name}"
        self.model, self.tokenizer = load_model(path)
        self.batch_size = batch_size

    def complete(self, prompts: Sequence[str], *, max_new_tokens: int, temperature: float = 0.0,
                 n: int = 1, seed: int = 0) -> list[list[Completion]]:
        from stages.models.generate import generate

        texts = generate(self.model, self.tokenizer, prompts, max_new_tokens=max_new_tokens,
                         do_sample=temperature > 0, temperature=temperature or 1.0,
                         num_samples=n, batch_size=self.batch_size, seed=seed)
        return [[Completion(t, self._count(t)) for t in outs] for outs in texts]

    def _count(self, text: str) -> int:
        # +1 for the <eos> that ended it (or the cap), as a served model's usage would count
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + 1


class OpenAICompatibleBackend:
    """`POST {base_url}/completions` of an OpenAI-compatible server (vLLM, TGI, llama.cpp...)."""

    def __init__(self, cfg: BackendConfig) -> None:
        assert cfg.base_url is not None
        self.name = f"openai:{cfg.model}"
        self.cfg = cfg
        self.url = cfg.base_url.rstrip("/") + "/completions"

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.cfg.api_key_env:
            key = os.environ.get(self.cfg.api_key_env)
            if not key:
                raise RuntimeError(f"backend: environment variable {self.cfg.api_key_env} "
                                   "(backend.api_key_env) is not set")
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps(body).encode()
        last: Exception | None = None
        for attempt in range(self.cfg.max_retries + 1):
            if attempt:
                time.sleep(min(10.0, 0.5 * 2 ** (attempt - 1)))  # back off before a retry
            req = urllib.request.Request(self.url, data=data, headers=self._headers(),
                                         method="POST")
            try:
                with urllib.request.urlopen(req, timeout=self.cfg.timeout_s) as resp:
                    return json.loads(resp.read())
            except urllib.error.HTTPError as err:
                if err.code < 500:  # a client error does not improve on retry
                    raise RuntimeError(f"backend {self.url}: HTTP {err.code}: "
                                       f"{err.read()[:500].decode(errors='replace')}") from None
                last = err
            except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
                last = getattr(err, "reason", err)
        raise RuntimeError(f"backend {self.url} unreachable after "
                           f"{self.cfg.max_retries + 1} tries: {last}")

    def complete(self, prompts: Sequence[str], *, max_new_tokens: int, temperature: float = 0.0,
                 n: int = 1, seed: int = 0) -> list[list[Completion]]:
        prompts = list(prompts)
        out: list[list[Completion]] = []
        for start in range(0, len(prompts), self.cfg.batch_size):
            chunk = prompts[start:start + self.cfg.batch_size]
            reply = self._post({"model": self.cfg.model, "prompt": chunk,
                                "max_tokens": max_new_tokens, "temperature": temperature,
                                "n": n, "seed": seed})
            choices = sorted(reply["choices"], key=lambda c: c["index"])
            if len(choices) != len(chunk) * n:
                raise RuntimeError(f"backend {self.url}: {len(choices)} choices for "
                                   f"{len(chunk)} prompts x n={n}")
            for i in range(len(chunk)):
                got = choices[i * n:(i + 1) * n]
                out.append([Completion(c["text"], int(c.get("n_tokens",
                                                             _approx_tokens(c["text"]))))
                            for c in got])
        return out


def _approx_tokens(text: str) -> int:
    # OpenAI reports usage per request, not per choice; a per-choice count is optional
    return max(1, len(text) // 4)


def make_backend(cfg: BackendConfig, *, root: str | Path = ".") -> Backend:
    if cfg.kind == "local":
        path = Path(cfg.model)
        return LocalHFBackend(path if path.is_absolute() else Path(root) / path,
                              batch_size=cfg.batch_size)
    return OpenAICompatibleBackend(cfg)
