"""Reward functions for the config-key test's probes, with known scores: the response's length in characters; a
judge of short responses; the length of each row's label (what shows that the labels reached the function)."""


def response_length(prompts: list, responses: list[str]) -> list[float]:
    return [float(len(r)) for r in responses]


def is_short(prompts: list, responses: list[str]) -> list[float]:
    """1 for a response of at most two characters, else 0 (a judge other than ``response_length``)."""
    return [float(len(r) <= 2) for r in responses]


def label_length(prompts: list, responses: list[str], labels: list | None = None) -> list[float]:
    """The length of each row's label (``data.label_key``), 0 for every row when the data has no labels."""
    return [float(len(label)) for label in labels] if labels is not None else [0.0] * len(responses)
