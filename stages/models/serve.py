"""A small OpenAI-compatible completions server over a local Hugging Face model folder.

What it is for: testing `OpenAICompatibleBackend` against a real HTTP server without a GPU or a
vLLM install, and serving a project's tiny model to any OpenAI-compatible client. It speaks the
subset of the API the backend uses:

    POST /v1/completions   {"model", "prompt": str | [str], "max_tokens", "temperature", "n",
                            "seed"} -> {"choices": [{"index", "text", "finish_reason",
                            "n_tokens"}], "usage": {...}}   (index = prompt_i * n + j)
    GET  /v1/models        the one model it serves
    GET  /health

    python -m stages.models.serve --model models/base --port 8000        # 127.0.0.1 by default
    PAPERLINE_SERVE_KEY=... python -m stages.models.serve --model models/base \\
        --api-key-env PAPERLINE_SERVE_KEY     # then clients must send `Authorization: Bearer`

The key is read from the environment variable NAMED on the command line, never passed as a
value, so it does not appear in `ps` output. Generation is `LocalHFBackend.complete`, one
request at a time (a lock around the model); greedy at temperature 0, so a client gets exactly
the local backend's completions. It prints `serving <model> on http://HOST:PORT/v1` once ready
(with `--port 0` the OS picks a free port; read it from that line). Stop it by PID (SIGTERM).
Not a production server: no streaming, no chat endpoint, no batching across requests.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

MAX_PROMPTS = 4096


class RequestError(ValueError):
    """A bad request body: answered with HTTP 400 and this message."""


def parse_request(body: dict[str, Any], served: str) -> dict[str, Any]:
    """Validate a /v1/completions body; returns prompts, n, max_tokens, temperature, seed."""
    if not isinstance(body, dict):
        raise RequestError("body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served:
        raise RequestError(f"model {model!r} is not served here (serving {served!r})")
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise RequestError("prompt must be a string or a non-empty list of strings")
    if len(prompts) > MAX_PROMPTS:
        raise RequestError(f"{len(prompts)} prompts in one request; at most {MAX_PROMPTS}")
    out: dict[str, Any] = {"prompts": prompts}
    for key, kind, default, lo in (("n", int, 1, 1), ("max_tokens", int, 16, 1),
                                   ("temperature", (int, float), 1.0, 0.0),
                                   ("seed", int, 0, 0)):
        value = body.get(key, default)
        if value is None:
            value = default
        if isinstance(value, bool) or not isinstance(value, kind) or value < lo:
            raise RequestError(f"{key} = {value!r}: expected a number >= {lo}")
        out[key] = value
    return out


def make_handler(backend: Any, served: str, api_key: str | None) -> type[BaseHTTPRequestHandler]:
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        server_version = "paperline-serve/1"

        def log_message(self, fmt: str, *args: Any) -> None:  # one short line per request
            sys.stderr.write(f"serve: {self.address_string()} {fmt % args}\n")

        def _send(self, code: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, code: int, message: str, kind: str) -> None:
            self._send(code, {"error": {"message": message, "type": kind, "code": code}})

        def _authorised(self) -> bool:
            if api_key is None:
                return True
            if self.headers.get("Authorization", "") == f"Bearer {api_key}":
                return True
            self._error(401, "missing or wrong API key (Authorization: Bearer ...)",
                        "authentication_error")
            return False

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.rstrip("/") == "/health":
                return self._send(200, {"status": "ok"})
            if not self._authorised():
                return None
            if self.path.rstrip("/") == "/v1/models":
                return self._send(200, {"object": "list", "data": [
                    {"id": served, "object": "model", "owned_by": "paperline"}]})
            return self._error(404, f"no route GET {self.path}", "not_found")

        def do_POST(self) -> None:  # noqa: N802
            if self.path.rstrip("/") != "/v1/completions":
                return self._error(404, f"no route POST {self.path} (this server has "
                                   "/v1/completions)", "not_found")
            if not self._authorised():
                return None
            try:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"null")
                req = parse_request(body, served)
            except (json.JSONDecodeError, UnicodeDecodeError):
                return self._error(400, "body is not valid JSON", "invalid_request_error")
            except RequestError as err:
                return self._error(400, str(err), "invalid_request_error")
            with lock:
                outs = backend.complete(req["prompts"], max_new_tokens=req["max_tokens"],
                                        temperature=float(req["temperature"]), n=req["n"],
                                        seed=req["seed"])
            choices, generated = [], 0
            for i, group in enumerate(outs):
                for j, c in enumerate(group):
                    generated += c.n_tokens
                    choices.append({"index": i * req["n"] + j, "text": c.text,
                                    "finish_reason": "length" if c.n_tokens > req["max_tokens"]
                                    else "stop", "logprobs": None, "n_tokens": c.n_tokens})
            return self._send(200, {"id": f"cmpl-{uuid.uuid4().hex[:16]}",
                                    "object": "text_completion", "created": int(time.time()),
                                    "model": served, "choices": choices,
                                    "usage": {"completion_tokens": generated}})

    return Handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stages.models.serve",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a local save_pretrained folder")
    parser.add_argument("--name", default=None, help="model name clients send (default: the "
                        "folder name)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port")
    parser.add_argument("--api-key-env", default=None, help="NAME of the environment variable "
                        "holding the key clients must send (the value never goes on the "
                        "command line)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)

    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            parser.error(f"--api-key-env {args.api_key_env}: that environment variable is "
                         "not set")
    folder = Path(args.model)
    if not (folder / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there; expected a save_pretrained "
                     "folder")
    import torch

    from stages.models.backend import LocalHFBackend

    torch.set_num_threads(max(1, args.threads))
    backend = LocalHFBackend(folder, batch_size=args.batch_size)
    served = args.name or folder.name
    httpd = ThreadingHTTPServer((args.host, args.port), make_handler(backend, served, api_key))
    def stop(*_: Any) -> None:          # SIGTERM: leave serve_forever now, close the socket
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    host, port = httpd.server_address[:2]
    print(f"serving {served} on http://{host}:{port}/v1", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
