# One-command entry points (see README). Everything lives in a local virtual environment.
#   make test   set up .venv, lint (ruff) and run the test suite (CPU, offline)
#   make test-floors   the scheduler, pipeline and LoRA tests against the lowest declared versions (.ci/floors.txt)
#   make demo   set up .venv and run the main job on the embedded default
#   make demo-experts   two-expert (Wan 2.2-style) distillation on digits, 3 seeds (45-55 min on a shared 2-core host)
# CPU machines take the local CPU build of torch (pinned); on a GPU machine run
#   make setup TORCH="torch"   (or pre-install your CUDA torch into .venv).
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
export HF_HUB_OFFLINE := 1

.PHONY: setup test test-floors demo demo-experts clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

# lint and format first (ruff, configured in pyproject.toml): seconds, and a failure names the line
test: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider

# The declared floors of diffusers/peft/transformers/accelerate (pinned in .ci/floors.txt) in a second venv, on the
# tests that exercise them. CI runs this after `make test`: 263 s from a fresh clone on 2 shared cores (157 s to
# build the venv, 106 s of tests; measured 2026-12-03).
FLOORS_VENV := .venv-floors
FLOORS_TESTS := tests/test_schedulers.py tests/test_pipelines.py tests/test_flow_pipelines.py $(wildcard tests/test_lora_*.py)

$(FLOORS_VENV)/.installed: pyproject.toml .ci/floors.txt
	python3 -m venv $(FLOORS_VENV)
	$(FLOORS_VENV)/bin/python -m pip install -q --upgrade pip
	$(FLOORS_VENV)/bin/python -m pip install -q "$(TORCH)"
	$(FLOORS_VENV)/bin/python -m pip install -q -e ".[dev]" -c .ci/floors.txt
	touch $@

test-floors: $(FLOORS_VENV)/.installed
	TRITON_INTERPRET=1 $(FLOORS_VENV)/bin/python -m pytest -q -p no:cacheprovider $(FLOORS_TESTS)

# rCM on the embedded digits teacher (training/configs/digits.yaml), then the evaluation table:
# outputs/digits/{report.md,samples.png,pytorch_lora_weights.safetensors}. One torch thread per process: on a
# 2-core box, one process per core (two DDP processes, docs/screens.md). `make demo ABLATIONS=1` adds the
# sCM-only, DMD-only and no-regression students to the same table; `make demo QUALITY=1` trains twice as long (outputs/digits-quality);
# DEMO_ARGS passes more (python training/demo_digits.py --help).
demo: setup
	$(PY) training/demo_digits.py $(if $(filter-out 0 no false,$(ABLATIONS)),--ablations) \
		$(if $(filter-out 0 no false,$(QUALITY)),--quality) $(DEMO_ARGS)

# Wan 2.2-style two experts on digits: both experts in one rCM run vs one expert's LoRA on both, 3 seeds
# each (training/configs/digits-experts.yaml), against the two-expert teacher: outputs/digits_experts/report.md.
# Not part of `make demo` (45-55 min on a 2-core host, docs/benchmarks.md); DEMO_ARGS passes more (training/demo_experts_digits.py --help).
demo-experts: setup
	$(PY) training/demo_experts_digits.py $(DEMO_ARGS)

clean:
	rm -rf $(VENV) $(FLOORS_VENV) outputs
