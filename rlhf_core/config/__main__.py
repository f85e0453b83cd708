"""``python -m rlhf_core.config``: every key with its default and meaning."""

from rlhf_core.config.pipeline import PipelineConfig
from rlhf_core.config.serialise import describe


def main() -> None:
    for key, default, help_text in describe(PipelineConfig):
        print(f"{key:45s} {default:28s} {help_text}")


if __name__ == "__main__":
    main()
