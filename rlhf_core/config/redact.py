"""Credentials out of URLs, so that a config can be logged, stored and hashed: a remote reward server's token or an
MLflow password never leaves the process."""

from __future__ import annotations


def redact_url(url: str) -> str:
    """``url`` without credentials (``user:password@``), query string and fragment: safe to log."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:  # unparsable (a bad port...): keep only what is before any '@', '?' or '#'
        head, sep, rest = url.partition("://")
        rest = rest.rpartition("@")[2] if sep else head.rpartition("@")[2]
        rest = rest.split("?", 1)[0].split("#", 1)[0]
        return f"{head}://{rest}" if sep else rest
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    netloc = f"{host}:{port}" if port is not None else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def redact_tracking_uri(uri: str) -> str:
    """An MLflow tracking URI without a ``user:password@`` (``redact_url``); a URI without one (``sqlite:////abs.db``,
    which ``redact_url`` would shorten) is kept as it is."""
    return redact_url(uri) if "@" in uri else uri
