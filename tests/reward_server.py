"""A real loopback HTTP reward server for tests (stdlib ``http.server``), scoring with the synthetic gold reward.

Protocol (``rlhf_core.rewards.RemoteRewardModel``): ``POST <any path>`` with ``{"prompts": [...], "responses":
[...]}`` answers ``{"scores": [...]}``, ``gold_reward(prompt, response)`` per row (a non-string prompt is scored as
its ``json.dumps``, as ``rlhf_core/assets/reward_fns/gold.py`` does).

As a helper::

    with serve(fail_status=503) as (url, server):
        ...
        server.state.requests  # POSTs received

As a script (prints ``listening on http://127.0.0.1:PORT`` once ready)::

    python tests/reward_server.py --port 8123 [--fail-status 503] [--delay 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root on the path for rlhf_core
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlhf_core.data.synthetic import gold_reward  # noqa: E402


@dataclass
class ServerState:
    """The server's behaviour (mutable while it runs) and what it has seen.

    ``fail_status``: answer this HTTP status (body ``fail_body``) instead of scores; ``fail_first``: only for the
    first that many requests (None: always). ``delay_s``: sleep before answering. ``extra_scores``: add (or, when
    negative, drop) scores to answer a wrong count. ``raw_body``: answer these bytes with status 200 instead.
    ``answer_key``: ``"scores"`` or ``"rewards"``."""

    fail_status: int | None = None
    fail_first: int | None = None
    fail_body: str = "overloaded"
    delay_s: float = 0.0
    extra_scores: int = 0
    raw_body: bytes | None = None
    answer_key: str = "scores"
    requests: int = 0
    batches: list[int] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    labels: list[Any] = field(default_factory=list)  # the "labels" of each request (None when it sent none)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


def gold_scores(prompts: list, responses: list[str]) -> list[float]:
    return [
        gold_reward(p if isinstance(p, str) else json.dumps(p), r) for p, r in zip(prompts, responses, strict=True)
    ]


class RewardHandler(BaseHTTPRequestHandler):
    server: RewardServer

    def log_message(self, format: str, *args: Any) -> None:  # quiet: tests read their own output
        pass

    def _answer(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        state = self.server.state
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        with state.lock:
            state.requests += 1
            n = state.requests
            state.paths.append(self.path)
        if state.delay_s:
            time.sleep(state.delay_s)
        if state.fail_status is not None and (state.fail_first is None or n <= state.fail_first):
            self._answer(state.fail_status, state.fail_body.encode(), "text/plain")
            return
        try:
            request = json.loads(raw)
            prompts, responses = request["prompts"], request["responses"]
            scores = gold_scores(prompts, responses)
        except (ValueError, KeyError, TypeError) as e:
            self._answer(400, f"bad request: {type(e).__name__}: {e}".encode(), "text/plain")
            return
        with state.lock:
            state.batches.append(len(scores))
            state.labels.append(request.get("labels"))
        if state.raw_body is not None:
            self._answer(200, state.raw_body, "text/plain")
            return
        if state.extra_scores > 0:
            scores += [0.0] * state.extra_scores
        elif state.extra_scores < 0:
            scores = scores[: state.extra_scores]
        self._answer(200, json.dumps({state.answer_key: scores}).encode())


class RewardServer(ThreadingHTTPServer):
    allow_reuse_address = True
    daemon_threads = True

    def __init__(self, port: int = 0, state: ServerState | None = None) -> None:
        self.state = state or ServerState()
        super().__init__(("127.0.0.1", port), RewardHandler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/score"


@contextmanager
def serve(port: int = 0, **options: Any) -> Iterator[tuple[str, RewardServer]]:
    """A reward server on 127.0.0.1 (``port`` 0: a free one) in a background thread: yields (url, server); the
    options are ``ServerState`` fields."""
    server = RewardServer(port, ServerState(**options))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server.url, server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--fail-status", type=int, default=None, help="answer this HTTP status to every request")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds to wait before each answer")
    args = parser.parse_args(argv)
    server = RewardServer(args.port, ServerState(fail_status=args.fail_status, delay_s=args.delay))
    print(f"listening on http://127.0.0.1:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever(poll_interval=0.05)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
