"""A reward function for the config-key test's score probes: the response's length in characters (known scores)."""


def response_length(prompts: list, responses: list[str]) -> list[float]:
    return [float(len(r)) for r in responses]
