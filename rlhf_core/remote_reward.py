"""The client of a remote HTTP reward server with a batch JSON API.

``POST <url>`` with ``{"prompts": [...], "responses": [...]}`` (and ``"labels": [...]`` when the data has labels, as
OpenRLHF sends them) answers ``{"scores": [...]}`` (or ``{"rewards": [...]}``), one finite number per row, in
order. Connection errors, read errors and HTTP 429/500/502/503/504 are retried with exponential backoff; what still
fails is a ``RemoteRewardError`` naming the key and the (redacted) URL: a failed request is never a score of 0.
"""

from __future__ import annotations

import json
import math
from urllib.parse import urlsplit

from rlhf_core.config import ConfigError, redact_url
from rlhf_core.errors import one_line

RETRY_STATUSES = (429, 500, 502, 503, 504)
EXCERPT_CHARS = 200


class RemoteRewardError(RuntimeError):
    """A remote reward server could not be reached, failed or gave an unusable answer; the message names the config
    key and the redacted URL."""


class RemoteRewardModel:
    """A client of an HTTP reward server with a batch JSON API (see the module docstring).

    ``key`` is the config key the URL came from, named in every error. ``retries``: retries after the first try
    (connection errors, read errors, HTTP 429/500/502/503/504), sleeping ``backoff_s * 2**(n - 1)`` before the n-th
    retry after the first; ``timeout_s`` bounds connecting and each read of every request; ``batch_size`` > 0
    splits a batch into requests of at most that many rows.
    """

    def __init__(
        self,
        url: str,
        key: str,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        batch_size: int = 0,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError(f"'{key}' = {redact_url(str(url))!r} is not an http:// or https:// URL")
        if timeout_s <= 0:
            raise ConfigError(f"'{key}': the reward server timeout must be > 0 (got {timeout_s})")
        if retries < 0 or backoff_s < 0 or batch_size < 0:
            raise ConfigError(
                f"'{key}': retries, backoff and batch size must be >= 0 (got {retries}, {backoff_s}, {batch_size})"
            )
        self.url = url
        self.key = key
        self.timeout_s = float(timeout_s)
        self.retries = int(retries)
        self.backoff_s = float(backoff_s)
        self.batch_size = int(batch_size)
        self.safe_url = redact_url(url)
        self._session = None

    # a picklable client (it can be sent to a worker): the session is made again on first use
    def __getstate__(self) -> dict:
        return {**self.__dict__, "_session": None}

    def __repr__(self) -> str:
        return f"RemoteRewardModel({self.safe_url!r}, key={self.key!r})"

    def __enter__(self) -> RemoteRewardModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    def session(self):
        if self._session is None:
            import requests
            from requests.adapters import HTTPAdapter
            from urllib3.util import Retry

            retry = Retry(
                total=self.retries,
                connect=self.retries,
                read=self.retries,
                status=self.retries,
                other=self.retries,
                redirect=0,
                status_forcelist=RETRY_STATUSES,
                backoff_factor=self.backoff_s,
                allowed_methods=Retry.DEFAULT_ALLOWED_METHODS | {"POST"},
                raise_on_status=False,
                raise_on_redirect=False,
            )
            session = requests.Session()
            adapter = HTTPAdapter(max_retries=retry)
            session.mount("http://", adapter)
            session.mount("https://", adapter)
            self._session = session
        return self._session

    def check(self, labels: list | None = None) -> None:
        """Probe the server with one row (prompt "", response "", and the first of ``labels`` when the data has
        labels), to fail before training starts."""
        self.score([""], [""], labels[:1] if labels else None)

    def score(self, prompts: list, responses: list[str], labels: list | None = None) -> list[float]:
        """One finite float per (prompt, response) row, in order (``labels``: one per row, sent as ``labels``); a
        RemoteRewardError otherwise."""
        prompts, responses = list(prompts), list(responses)
        if len(prompts) != len(responses) or (labels is not None and len(labels) != len(prompts)):
            raise ValueError(f"{len(prompts)} prompts for {len(responses)} responses and {len(labels or [])} labels")
        step = self.batch_size or max(1, len(prompts))
        scores: list[float] = []
        for start in range(0, len(prompts), step):
            rows = slice(start, start + step)
            scores += self._post(prompts[rows], responses[rows], None if labels is None else list(labels[rows]))
        return scores

    def _fail(self, problem: str) -> RemoteRewardError:
        return RemoteRewardError(f"'{self.key}': the reward server {self.safe_url} {problem}")

    def _excerpt(self, text: str) -> str:
        # the server may echo the request line: never let the URL's secrets through
        parts = urlsplit(self.url)
        for secret in (parts.password, parts.username, parts.query, parts.fragment):
            if secret:
                text = text.replace(secret, "***")
        return one_line(text, EXCERPT_CHARS) or "(empty body)"

    def _post(self, prompts: list, responses: list[str], labels: list | None = None) -> list[float]:
        import requests

        request: dict[str, list] = {"prompts": prompts, "responses": responses}
        if labels is not None:
            request["labels"] = labels
        try:
            body = json.dumps(request)
        except (TypeError, ValueError) as e:
            what = "prompts or labels" if labels is not None else "prompts"
            raise self._fail(f"cannot be sent these {what}: they are not JSON ({type(e).__name__})") from None
        tries_max = self.retries + 1
        try:
            resp = self.session().post(
                self.url, data=body, headers={"Content-Type": "application/json"}, timeout=self.timeout_s
            )
        except requests.RequestException as e:
            raise self._fail(f"failed after {tries_max} {_tries(tries_max)}: {self._describe(e)}") from None
        history = getattr(getattr(resp.raw, "retries", None), "history", None)
        tries = len(history) + 1 if history is not None else 1
        if not 200 <= resp.status_code < 300:
            raise self._fail(
                f"answered HTTP {resp.status_code} after {tries} {_tries(tries)}: {self._excerpt(resp.text)}"
            )
        try:
            answer = json.loads(resp.content)
        except ValueError:
            raise self._fail(f"answered HTTP {resp.status_code} with non-JSON: {self._excerpt(resp.text)}") from None
        if not isinstance(answer, dict) or not ("scores" in answer or "rewards" in answer):
            what = f"keys {sorted(map(str, answer))}" if isinstance(answer, dict) else type(answer).__name__
            raise self._fail(f"answered JSON without 'scores' (or 'rewards'): got {one_line(what, 100)}")
        values = answer["scores"] if "scores" in answer else answer["rewards"]
        if not isinstance(values, list):
            raise self._fail(f"answered 'scores' = {type(values).__name__}, not a list")
        if len(values) != len(prompts):
            raise self._fail(f"answered {len(values)} scores for {len(prompts)} rows")
        scores = []
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise self._fail(f"answered {one_line(repr(v), 60)} for row {i + 1}, not a number")
            if not math.isfinite(v):
                raise self._fail(f"answered {v} for row {i + 1}: scores must be finite")
            scores.append(float(v))
        return scores

    def _describe(self, e: BaseException) -> str:
        """The kind of a transport error, without the URL (urllib3's messages repeat the path and query)."""
        import requests
        import urllib3.exceptions

        chain = _chain(e)
        root = _root_oserror(chain)
        detail = f" ({type(root).__name__}: {root.strerror})" if root is not None and root.strerror else ""
        # NewConnectionError is a urllib3 ConnectTimeoutError: a refused connection is not a timeout
        if any(isinstance(c, urllib3.exceptions.NewConnectionError) for c in chain):
            return f"cannot connect{detail or f' ({type(root or e).__name__})'}"
        if isinstance(e, requests.Timeout) or any(
            isinstance(c, TimeoutError | urllib3.exceptions.TimeoutError) for c in chain
        ):
            return f"timed out (timeout {self.timeout_s:g}s)"
        if root is not None:
            return f"connection error{detail or f' ({type(root).__name__})'}"
        return type(e).__name__


def _tries(n: int) -> str:
    return "try" if n == 1 else "tries"


def _chain(e: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    stack: list[BaseException | None] = [e]
    while stack:
        cur = stack.pop()
        if cur is None or any(cur is s for s in seen):
            continue
        seen.append(cur)
        stack += [cur.__cause__, cur.__context__, getattr(cur, "reason", None)]
        stack += [a for a in getattr(cur, "args", ()) if isinstance(a, BaseException)]
    return seen


def _root_oserror(chain: list[BaseException]) -> OSError | None:
    """The innermost plain OSError (ConnectionRefusedError, socket.gaierror...) below a requests/urllib3 error."""
    import requests
    import urllib3.exceptions

    found = None
    for c in chain:
        if isinstance(c, OSError) and not isinstance(c, requests.RequestException | urllib3.exceptions.HTTPError):
            found = c
    return found
