# The README's two commands: `make demo` (main job on the embedded default) and `make test` (the test suite).
PY := .venv/bin/python
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# One place for DeepSpeed's compiled ops (CPU Adam, shared-memory comm) so tests and CI pay the build once.
export TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/torch_extensions

.PHONY: setup demo test test-fast clean

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) -m rlhf_core.jobs.pipeline --config deployments/configs/demo.yaml $(ARGS)

test: setup
	$(PY) -m pytest tests -q $(ARGS)

test-fast: setup
	$(PY) -m pytest tests -q -m "not slow" $(ARGS)

clean:
	rm -rf runs .pytest_cache
