"""Row functions for the verifier pool's tests: module-level and importing nothing heavy, since the pool's workers
import them by name."""

import time


def sleep_row(seconds: float) -> float:
    time.sleep(seconds)
    return 1.0


def failing_row(message: str) -> float:
    raise ValueError(message)
