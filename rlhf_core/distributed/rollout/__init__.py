"""Rollout engines: the ``RolloutEngine`` protocol (``engine``), its vLLM and Hugging Face backends, and the Ray
group that places and calls them (``group``)."""
