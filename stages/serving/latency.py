"""Latency profile: how long one prefill batch, one decode step and one KV transfer take.

The simulator never invents a timing: every duration comes from a `LatencyProfile`, a handful of
constants fitted to measurements. Two profiles ship as data: the one stage `profile_engine`
measures on this machine (the project's tiny base model through `transformers`), and `a100`,
published A100 constants (file `profiles/a100.json`, its `source` field cites them). All times
are in seconds, all sizes in tokens or bytes.

The forms are the linear ones DistServe (Zhong et al., OSDI'24, arXiv 2401.09670, sec. 4 and its
simulator) and Vidur (Agrawal et al., MLSys'24) fit:

    prefill of a batch, prompt lengths l_i, nothing cached:
        T_pre = s0 + a * sum_i l_i + b * sum_i l_i^2
    the same with h_i tokens of history already in the KV cache (multi-round, incremental prefill):
        T_pre = s0 + a * sum_i l_i + b * sum_i (l_i^2 + 2 l_i h_i)
    one decode step of B sequences whose KV caches hold C tokens in all:
        T_dec = s0' + c * B + d * C
    moving the KV cache of n tokens over a link:
        T_kv  = t0 + n * kv_bytes_per_token / link_bytes_per_s

Why the history term is `l^2 + 2 l h`: b * l^2 is the attention cost of l tokens attending to each
other, which is proportional to the l^2 / 2 query-key pairs of causal attention. An incremental
prefill of l new tokens over h cached ones computes l*h + l^2/2 pairs, i.e. b * (l^2 + 2 l h);
h = 0 gives back DistServe's form. AMPD (arXiv 2602.14516, sec. 2) writes the same quantity as
a2 * l_i * (l_h + l_i / 2).

Not modelled: piecewise fits (DistServe switches decode constants above batch 95; the shipped
profile uses the small-batch constants), pipeline parallelism, CUDA-graph padding, sampling time.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stages.core import io

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"


class ProfileError(ValueError):
    """A latency profile file that cannot be used; the message names the file and the field."""


class LatencyProfile(BaseModel):
    """Constants of the DistServe/Vidur linear latency model (module docstring). Seconds."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = Field(min_length=1, description="short name, e.g. 'a100' or 'measured'")
    source: str = Field(min_length=1, description="where the constants come from: a citation "
                                                   "or the stage and model that measured them")
    prefill_s0: float = Field(ge=0, description="fixed cost of one prefill batch (s)")
    prefill_s_per_token: float = Field(ge=0, description="a: seconds per prompt token")
    prefill_s_per_token2: float = Field(0.0, ge=0, description="b: seconds per squared token "
                                                                "(attention)")
    decode_s0: float = Field(ge=0, description="fixed cost of one decode step (s)")
    decode_s_per_seq: float = Field(ge=0, description="c: seconds per sequence in the batch")
    decode_s_per_ctx_token: float = Field(ge=0, description="d: seconds per token of KV context "
                                                            "read by the step")
    kv_bytes_per_token: int = Field(gt=0, description="KV cache bytes of one token, all layers "
                                                      "(2 * layers * hidden * dtype bytes)")
    kv_block_tokens: int = Field(16, gt=0, description="tokens per KV block (vLLM's block size)")
    transfer_s0: float = Field(0.0, ge=0, description="fixed cost of one KV transfer (s)")
    link_bytes_per_s: float = Field(gt=0, description="KV link bandwidth (bytes/s)")
    fit: dict[str, float] = Field(default_factory=dict,
                                  description="fit errors (MAPE, R^2) when measured")

    # --- the model's equations ------------------------------------------------------------------

    def prefill_time(self, new: int, hist: int = 0) -> float:
        """T_pre of a batch of one: `new` tokens to prefill over `hist` cached tokens."""
        return (self.prefill_s0 + self.prefill_s_per_token * new
                + self.prefill_s_per_token2 * new * (new + 2 * hist))

    def prefill_batch_time(self, new: Sequence[int], hist: Sequence[int]) -> float:
        """T_pre of one batch: new[i] tokens to prefill over hist[i] cached tokens (docstring)."""
        linear = quad = 0
        for n, h in zip(new, hist, strict=True):
            linear += n
            quad += n * (n + 2 * h)
        return self.prefill_s0 + self.prefill_s_per_token * linear + self.prefill_s_per_token2 * quad

    def decode_step_time(self, batch: int, ctx_tokens: float) -> float:
        """T_dec of one step of `batch` sequences holding `ctx_tokens` KV tokens in all."""
        return self.decode_s0 + self.decode_s_per_seq * batch + self.decode_s_per_ctx_token * ctx_tokens

    def kv_transfer_time(self, tokens: int) -> float:
        """T_kv of moving the KV cache of `tokens` tokens over one link (no queueing)."""
        return self.transfer_s0 + tokens * self.kv_bytes_per_token / self.link_bytes_per_s

    def blocks(self, tokens: int) -> int:
        """KV blocks that hold `tokens` tokens."""
        return -(-tokens // self.kv_block_tokens)


# --- files ---------------------------------------------------------------------------------------


def profile_path(name_or_path: str | os.PathLike[str]) -> Path:
    """A shipped profile by name ('a100') or any JSON file by path."""
    text = os.fspath(name_or_path)
    if os.sep not in text and not text.endswith(".json"):
        shipped = PROFILES_DIR / f"{text}.json"
        if not shipped.is_file():
            known = sorted(p.stem for p in PROFILES_DIR.glob("*.json"))
            raise ProfileError(f"no shipped latency profile {text!r}; shipped: {', '.join(known)} "
                               f"(or give the path of a profile JSON file)")
        return shipped
    return Path(text)


def load_profile(name_or_path: str | os.PathLike[str]) -> LatencyProfile:
    """Read and validate a profile; every defect is a ProfileError naming the file and field."""
    path = profile_path(name_or_path)
    if not path.is_file():
        raise ProfileError(f"{path}: no such latency profile file (stage `profile_engine` writes "
                           f"the measured one)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: expected a JSON object of profile fields, "
                           f"got {type(data).__name__}")
    try:
        return LatencyProfile.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
            + ("" if err["type"] == "missing" else f" (got {err.get('input')!r})")
            for err in exc.errors())
        raise ProfileError(f"{path}: invalid latency profile: {problems}") from None


def save_profile(profile: LatencyProfile, path: str | os.PathLike[str]) -> Path:
    """Write a profile as JSON, atomically (stages.core.io)."""
    return io.write_json(path, profile.model_dump(mode="json"))

