"""``python scripts/gpu_check [--dry-run] [--only LIST]`` (what ``scripts/gpu_check.sh`` runs, and how the driver
starts its workers), or ``python -m scripts.gpu_check`` from the checkout's root."""

import sys
from pathlib import Path

if __package__:
    from .runner import main
else:
    # Run as a folder: the package is imported as ``gpu_check`` from scripts/, which replaces this folder on the path
    # (its module names would shadow others'); spawned processes inherit the path and find the checks there.
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    from gpu_check.runner import main

if __name__ == "__main__":
    sys.exit(main())
