"""Check 2's real server: continuous batching on `transformers`, and a bounded Poisson load driver.

The simulator is only worth what it is checked against; this is the real thing it is checked
against at tiny scale: an HTTP server on 127.0.0.1 serving the project's base model with
iteration-level (continuous) batching, as Orca (OSDI'22) and vLLM (SOSP'23) do, driven by a
bounded Poisson load; every request's TTFT and end-to-end latency is recorded.

    python -m stages.serving.server --model models/base --port 0     # prints the URL once ready
    POST /generate  {"prompt_ids": [1, 17, 5], "max_new_tokens": 16, "ignore_eos": false}
                 -> {"output_ids", "prompt_len", "output_len", "ttft_s", "e2e_s", "queue_s",
                     "t_arrive", "t_first", "t_done"}          (times: time.monotonic(), s)
    GET  /health, GET /iterations (the engine's log: one row per prefill / decode iteration)

    df = measure_server("models/base", rates=[2, 5, 10], n=300, seed=0)   # polars, per request

The schedule (what the simulator must reproduce; one engine thread, `stages.serving.engine`):
each iteration (1) admits every waiting request, FCFS, while fewer than `max_batch` run, as one
prefill batch, which also yields each one's first token (TTFT = arrival -> end of that
prefill); then (2) runs one decode step of the whole running batch (the co-running decodes wait
for the prefill: the stall a local prefill causes). A request leaves after its
`max_new_tokens`-th token (or `<eos>` unless `ignore_eos`), so a request of n output tokens
takes one prefill and n - 1 decode steps. No KV limit below `max_batch` (the tiny model's
cache is small); greedy decoding only.

Timing: TTFT and E2E are taken by the server from the moment its HTTP handler has read the
request (no streaming: the reply comes at the end); the driver also records its own round trip
(`client_e2e_s`). `time.monotonic()` is one system-wide clock on Linux, so the server's arrival
times line up with the driver's schedule: `arrival_s` is the arrival the server saw, relative to
the start of that rate's run, and is what a simulator replays.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

READY = "serving on http://"


# --- the engine loop -----------------------------------------------------------------------------

class RequestError(ValueError):
    """A bad request body: answered with HTTP 400 and this message."""


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    ignore_eos: bool = False
    t_arrive: float = field(default_factory=time.monotonic)
    t_admit: float = 0.0                  # its prefill started
    t_first: float = 0.0                  # its first token exists
    t_done: float = 0.0
    tokens: list[int] = field(default_factory=list)
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def result(self) -> dict[str, Any]:
        return {"output_ids": self.tokens, "prompt_len": len(self.prompt),
                "output_len": len(self.tokens), "ttft_s": self.t_first - self.t_arrive,
                "e2e_s": self.t_done - self.t_arrive, "queue_s": self.t_admit - self.t_arrive,
                "t_arrive": self.t_arrive, "t_first": self.t_first, "t_done": self.t_done}


class ContinuousBatcher:
    """The one thread that runs the model: admit (prefill) waiting requests, then decode a step."""

    def __init__(self, engine: Any, eos_id: int, vocab_size: int, max_batch: int = 64) -> None:
        self.engine, self.eos_id, self.vocab_size = engine, int(eos_id), int(vocab_size)
        self.max_batch = max_batch
        self.waiting: queue.Queue[Request] = queue.Queue()
        self.iterations: deque[dict[str, float]] = deque(maxlen=200_000)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    def start(self) -> "ContinuousBatcher":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def parse(self, body: Any) -> Request:
        """A validated Request from a /generate body (RequestError naming the field if bad)."""
        if not isinstance(body, dict):
            raise RequestError("body must be a JSON object")
        ids = body.get("prompt_ids")
        if (not isinstance(ids, list) or not ids
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
            raise RequestError("prompt_ids must be a non-empty list of token ids")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise RequestError(f"prompt_ids: ids must lie in [0, {self.vocab_size})")
        new = body.get("max_new_tokens", 16)
        if isinstance(new, bool) or not isinstance(new, int) or new < 1:
            raise RequestError(f"max_new_tokens = {new!r}: expected an integer >= 1")
        if len(ids) + new > self.engine.max_positions:
            raise RequestError(f"prompt_ids ({len(ids)}) + max_new_tokens ({new}) exceed the "
                               f"model's {self.engine.max_positions} positions")
        ignore = body.get("ignore_eos", False)
        if not isinstance(ignore, bool):
            raise RequestError(f"ignore_eos = {ignore!r}: expected true or false")
        return Request(prompt=ids, max_new_tokens=new, ignore_eos=ignore)

    def submit(self, req: Request) -> Request:
        self.waiting.put(req)
        return req

    def _finished(self, req: Request) -> bool:
        return (len(req.tokens) >= req.max_new_tokens
                or (not req.ignore_eos and req.tokens[-1] == self.eos_id))

    def _retire(self, batch: Any, reqs: list[Request], now: float) -> tuple[Any, list[Request]]:
        keep = []
        for i, r in enumerate(reqs):
            if self._finished(r):
                r.t_done = now
                r.done.set()
            else:
                keep.append(i)
        if len(keep) == len(reqs):
            return batch, reqs
        return self.engine.select(batch, keep), [reqs[i] for i in keep]

    def _admit(self, running: int) -> list[Request]:
        new: list[Request] = []
        try:
            if not running:                     # idle: wait a little for work
                new.append(self.waiting.get(timeout=0.05))
            while running + len(new) < self.max_batch:
                new.append(self.waiting.get_nowait())
        except queue.Empty:
            pass
        return new

    def _loop(self) -> None:
        batch, reqs = None, []
        while not self._stop.is_set():
            new: list[Request] = []
            try:
                new = self._admit(len(reqs))
                if new:
                    t0 = time.monotonic()
                    fresh, first = self.engine.prefill([r.prompt for r in new])
                    now = time.monotonic()
                    for r, tok in zip(new, first.tolist()):
                        r.t_admit, r.t_first = t0, now
                        r.tokens.append(tok)
                    self.iterations.append({
                        "kind": "prefill", "start": t0, "seconds": now - t0, "batch": len(new),
                        "sum_l": sum(len(r.prompt) for r in new),
                        "sum_l2": sum(len(r.prompt) ** 2 for r in new),
                        "width": max(len(r.prompt) for r in new), "ctx_tokens": 0})
                    batch, reqs = self._retire(self.engine.merge(batch, fresh), reqs + new, now)
                if reqs:
                    ctx, width = batch.context_tokens, int(batch.mask.shape[1])
                    t0 = time.monotonic()
                    nxt = self.engine.decode(batch).tolist()
                    now = time.monotonic()
                    for r, tok in zip(reqs, nxt):
                        r.tokens.append(tok)
                    self.iterations.append({
                        "kind": "decode", "start": t0, "seconds": now - t0, "batch": len(reqs),
                        "sum_l": 0, "sum_l2": 0, "width": width, "ctx_tokens": ctx})
                    batch, reqs = self._retire(batch, reqs, now)
            except Exception as err:  # noqa: BLE001 - fail the requests in flight, keep serving
                sys.stderr.write(f"server: engine error: {err!r}\n")
                for r in reqs + new:
                    if not r.done.is_set():
                        r.error = repr(err)
                        r.done.set()
                batch, reqs = None, []


# --- HTTP ----------------------------------------------------------------------------------------

def make_handler(batcher: ContinuousBatcher, timeout_s: float) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "paperline-serving/1"

        def log_message(self, fmt: str, *args: Any) -> None:  # quiet: one line per request
            pass                                               # would cost more than a step

        def _send(self, code: int, payload: Any) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            route = self.path.rstrip("/")
            if route == "/health":
                return self._send(200, {"status": "ok"})
            if route == "/iterations":
                return self._send(200, list(batcher.iterations))
            return self._send(404, {"error": f"no route GET {self.path}"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path.rstrip("/") != "/generate":
                return self._send(404, {"error": f"no route POST {self.path} (this server has "
                                                 "/generate)"})
            try:
                length = int(self.headers.get("Content-Length") or 0)
                req = batcher.parse(json.loads(self.rfile.read(length) or b"null"))
            except (json.JSONDecodeError, UnicodeDecodeError):
                return self._send(400, {"error": "body is not valid JSON"})
            except RequestError as err:
                return self._send(400, {"error": str(err)})
            if not batcher.submit(req).done.wait(timeout_s):
                return self._send(504, {"error": f"not finished within {timeout_s} s"})
            if req.error is not None:
                return self._send(500, {"error": req.error})
            return self._send(200, req.result())

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # A Poisson burst opens many connections at once; the default backlog of 5 would drop SYNs
    # and the kernel's 1 s retransmit would show up as latency that is not the engine's.
    request_queue_size = 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stages.serving.server",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a local save_pretrained folder")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    parser.add_argument("--max-batch", type=int, default=64, help="most sequences running")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    args = parser.parse_args(argv)
    if not (Path(args.model) / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there; expected a save_pretrained "
                     "folder")
    if args.max_batch < 1 or args.threads < 1:
        parser.error("--max-batch and --threads must be >= 1")
    import torch

    from stages.models.generate import load_model
    from stages.serving.engine import Engine

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    batcher = ContinuousBatcher(Engine(model, tokenizer.pad_token_id), tokenizer.eos_token_id,
                                len(tokenizer), args.max_batch).start()
    httpd = _Server((args.host, args.port), make_handler(batcher, args.timeout))

    def stop(*_: Any) -> None:          # SIGTERM: leave serve_forever now, close the socket
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    host, port = httpd.server_address[:2]
    print(f"{READY}{host}:{port}", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
        batcher.stop()
    return 0


# --- the server as a process, and the load driver ------------------------------------------------

class ServerProcess:
    """`python -m stages.serving.server` in a child process on a free loopback port; stopped by
    PID (SIGTERM, then SIGKILL) on exit.

        with ServerProcess("models/base") as srv:
            post(srv.url, {"prompt_ids": [1, 5], "max_new_tokens": 4})
    """

    def __init__(self, model_dir: str | Path, *, max_batch: int = 64, threads: int = 1,
                 start_timeout_s: float = 120.0) -> None:
        self.args = [sys.executable, "-m", "stages.serving.server", "--model", str(model_dir),
                     "--port", "0", "--max-batch", str(max_batch), "--threads", str(threads)]
        # The child imports this very checkout (not whatever `stages` an install points at).
        root = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        self.env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": path}
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def __enter__(self) -> "ServerProcess":
        # stderr to a file, not a pipe: a pipe nobody reads would block the server once full.
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(self.args, env=self.env, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True)
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(self.start_timeout_s)
        if not line or not line[0].startswith(READY):
            self._stop()
            self.stderr.seek(0)
            err = self.stderr.read()[-3000:]
            self.stderr.close()
            raise RuntimeError(f"serving server did not start within {self.start_timeout_s} s: "
                               f"{(line or [''])[0]!r}\n{err}")
        self.url = "http://" + line[0][len(READY):].strip()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop()
        self.stderr.close()

    def _stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)       # by PID
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def iterations(self) -> list[dict[str, float]]:
        with urllib.request.urlopen(self.url + "/iterations", timeout=30) as resp:
            return json.loads(resp.read())


def post(url: str, body: dict[str, Any], timeout_s: float = 600.0) -> dict[str, Any]:
    """POST /generate; the server's JSON reply (RuntimeError with its message on 4xx/5xx)."""
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        raise RuntimeError(f"{url}/generate: HTTP {err.code}: "
                           f"{err.read()[:500].decode(errors='replace')}") from None


class LoadConfig(BaseModel):
    """The requests check 2 sends (the same set at every rate: common random numbers)."""

    model_config = ConfigDict(extra="forbid")

    prompt_len_min: int = Field(8, ge=1, description="prompt tokens, uniform in [min, max]")
    prompt_len_max: int = Field(64, ge=1)
    output_len_min: int = Field(8, ge=1, description="output tokens, uniform in [min, max]; "
                                "`ignore_eos` makes every request produce exactly its draw")
    output_len_max: int = Field(32, ge=1)
    max_batch: int = Field(64, ge=1, le=4096, description="the server's most running sequences")
    threads: int = Field(1, ge=1, le=256, description="torch threads of the server's engine "
                         "(profile_engine must measure with the same number)")
    warmup_requests: int = Field(3, ge=0, le=1000, description="untimed requests sent one at a "
                                 "time before the first rate (first-call costs)")
    request_timeout_s: float = Field(600.0, gt=0, description="seconds one request may take")

    @model_validator(mode="after")
    def _ranges(self) -> "LoadConfig":
        for what in ("prompt_len", "output_len"):
            lo, hi = getattr(self, f"{what}_min"), getattr(self, f"{what}_max")
            if lo > hi:
                raise ValueError(f"{what}_min = {lo} > {what}_max = {hi}")
        return self


def make_workload(n: int, seed: int, load: LoadConfig, token_ids: Sequence[int]
                  ) -> list[dict[str, Any]]:
    """n requests: random prompt tokens, lengths uniform in the configured ranges, and a unit
    exponential gap before each (divided by the rate: the same draws at every rate)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = np.asarray(list(token_ids))
    out = []
    for i in range(n):
        plen = int(rng.integers(load.prompt_len_min, load.prompt_len_max + 1))
        olen = int(rng.integers(load.output_len_min, load.output_len_max + 1))
        out.append({"request": i, "gap": float(rng.exponential(1.0)),
                    "prompt_ids": rng.choice(ids, size=plen).tolist(), "max_new_tokens": olen})
    return out


def drive(url: str, workload: list[dict[str, Any]], rate: float,
          timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """Send the workload as a Poisson process of `rate` requests/s (one thread per request in
    flight, so a slow server never delays the next arrival); return one row per request once
    all are answered."""
    rows: list[dict[str, Any]] = [{} for _ in workload]
    start = time.monotonic()

    def one(i: int, w: dict[str, Any], scheduled: float) -> None:
        sent = time.monotonic()
        reply = post(url, {"prompt_ids": w["prompt_ids"], "max_new_tokens": w["max_new_tokens"],
                           "ignore_eos": True}, timeout_s)
        rows[i] = {"rate": rate, "request": w["request"], "scheduled_s": scheduled,
                   "arrival_s": reply["t_arrive"] - start, "prompt_len": reply["prompt_len"],
                   "output_len": reply["output_len"], "ttft_s": reply["ttft_s"],
                   "e2e_s": reply["e2e_s"], "queue_s": reply["queue_s"],
                   "client_e2e_s": time.monotonic() - sent}

    scheduled = 0.0
    with ThreadPoolExecutor(max_workers=max(1, len(workload))) as pool:
        futures = []
        for i, w in enumerate(workload):
            scheduled += w["gap"] / rate
            time.sleep(max(0.0, start + scheduled - time.monotonic()))
            futures.append(pool.submit(one, i, w, scheduled))
        for f in futures:
            f.result()                      # re-raises a failed request
    return rows


def measure_server(model_dir: str | Path, rates: Sequence[float], n: int, seed: int,
                   load: LoadConfig | None = None, url: str | None = None) -> Any:
    """Serve `model_dir`, send the same n requests at each rate (req/s), one rate after the
    other, each closed when all its requests are answered; a polars DataFrame, one row per
    request: rate, request, scheduled_s, arrival_s, prompt_len, output_len, ttft_s, e2e_s,
    queue_s, client_e2e_s (seconds). `url`: drive that running server of `model_dir` instead
    of starting one (then `load.max_batch` / `load.threads` are the caller's business)."""
    import polars as pl
    from transformers import AutoConfig, AutoTokenizer

    load = load or LoadConfig()
    rates = list(rates)
    if not rates or any(not (r > 0) for r in rates):
        raise ValueError(f"rates = {rates}: expected a non-empty list of rates > 0 (req/s)")
    if n < 1:
        raise ValueError(f"n = {n}: expected at least one request")
    folder = Path(model_dir)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: no config.json; expected a save_pretrained folder")
    positions = AutoConfig.from_pretrained(str(folder), local_files_only=True) \
        .max_position_embeddings
    if load.prompt_len_max + load.output_len_max > positions:
        raise ValueError(f"prompt_len_max + output_len_max = "
                         f"{load.prompt_len_max + load.output_len_max} exceeds the model's "
                         f"{positions} positions")
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    specials = set(tokenizer.all_special_ids)
    workload = make_workload(n, seed, load, [i for i in range(len(tokenizer))
                                             if i not in specials])
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        if url is None:
            url = stack.enter_context(ServerProcess(folder, max_batch=load.max_batch,
                                                    threads=load.threads)).url
        for w in workload[:load.warmup_requests]:
            post(url, {"prompt_ids": w["prompt_ids"], "max_new_tokens": w["max_new_tokens"]},
                 load.request_timeout_s)
        for rate in rates:
            rows += drive(url, workload, float(rate), load.request_timeout_s)
    return pl.DataFrame(rows).sort("rate", "request")


if __name__ == "__main__":
    raise SystemExit(main())
