"""Stage progress for listeners in this process: the terminal display of ``rlhf run`` (``flows.console``) subscribes;
the stage task and the flow publish.

Each event is a dict with ``event`` and ``stage``:

- ``started``:  ``kind``, ``attempt`` (1 for the first run of the task, 2 and up for its retries) -- a job launched;
- ``step``:     ``step``, ``total``, ``metrics`` -- a logged step (the job's ``step`` event as it is);
- ``resumed``:  ``step`` -- the job continues from its checkpoint of that step;
- ``finished``: ``kind``, ``state`` (the task's final state name: ``Completed``, ``Cached``, ``Failed``...),
  ``duration_s``, ``metrics`` -- the flow has the task's final state.

Events come from the stage task's thread and from the launcher's watcher thread. A listener that raises is dropped
with a warning: the display must never fail a run.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

Listener = Callable[[dict], None]
_LISTENERS: list[Listener] = []
_LOCK = threading.Lock()


def subscribe(listener: Listener) -> Callable[[], None]:
    """Add ``listener``; returns the function that removes it again."""
    with _LOCK:
        _LISTENERS.append(listener)

    def unsubscribe() -> None:
        with _LOCK:
            if listener in _LISTENERS:
                _LISTENERS.remove(listener)

    return unsubscribe


def publish(event: dict) -> None:
    """Hand ``event`` to every listener, in the order they subscribed."""
    with _LOCK:
        listeners = list(_LISTENERS)
    for listener in listeners:
        try:
            listener(event)
        except Exception as e:  # a display bug must not fail the stage
            print(f"warning: a progress listener failed and is dropped ({e!r})", file=sys.stderr)
            with _LOCK:
                if listener in _LISTENERS:
                    _LISTENERS.remove(listener)
