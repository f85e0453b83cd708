"""Clusters that refuse: a job given one must turn bad input down before it starts what the cluster refuses.

``NoWorkers`` is Ray as the jobs use it (started, or the test session's, with its resources for the capacity checks)
except that any worker group, rollout engine or training group fails the test. ``NoRay`` also refuses to start (or
connect to) Ray and to say what it has.
"""

from __future__ import annotations

from typing import Any, NoReturn

from rlhf_core.distributed.cluster import RayCluster


class NoWorkers(RayCluster):
    def __init__(self, what: str = "a worker was started despite bad input"):
        super().__init__()
        self.what = what

    def refuse(self) -> NoReturn:
        raise AssertionError(self.what)

    def group(self, *args: Any, **kwargs: Any) -> Any:
        self.refuse()

    def engines(self, *args: Any, **kwargs: Any) -> Any:
        self.refuse()

    def run_group(self, *args: Any, **kwargs: Any) -> Any:
        self.refuse()


class NoRay(NoWorkers):
    def __init__(self, what: str = "the job started Ray or its workers despite bad input"):
        super().__init__(what)

    def start(self, min_cpus: float = 1) -> None:
        self.refuse()

    def resources(self) -> dict[str, float]:
        self.refuse()

    def nodes(self) -> list[dict[str, float]]:
        self.refuse()
