"""``python -m rlhf_core.jobs.ppo --config FILE [key=value ...]``: the PPO stage (``controller.main``)."""

from __future__ import annotations

from rlhf_core.jobs.ppo.controller import main

if __name__ == "__main__":
    main()
