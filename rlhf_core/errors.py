"""Errors as one line of text: every refusal and failure the project prints is a single line.

``one_line`` flattens a message of our own (all of it, whitespace runs made one space); ``first_line`` summarises a
foreign exception (a library's, often with a long multi-line message) as its type and first line.
"""

from __future__ import annotations


def one_line(text: str, limit: int | None = None) -> str:
    """``text`` with every run of whitespace (newlines included) made one space; longer than ``limit`` characters, cut
    to that length with ``...`` at its end."""
    text = " ".join(str(text).split())
    return text if limit is None or len(text) <= limit else text[: limit - 3] + "..."


def first_line(error: BaseException, limit: int | None = 200) -> str:
    """``<Type>: <first non-blank line of the message>``, cut at ``limit`` characters (None: uncut); ``<Type>`` alone
    for an empty message. A first line ending with a colon is joined with the next: the reason is there."""
    text = [line.strip() for line in str(error).splitlines() if line.strip()]
    if len(text) > 1 and text[0].endswith(":"):
        text = [f"{text[0]} {text[1]}"]
    return f"{type(error).__name__}: {text[0][:limit]}" if text else type(error).__name__
