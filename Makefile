# One-command entry points (see README). Everything lives in a local virtual environment.
#   make test   set up .venv and run the test suite (CPU, offline)
#   make demo   set up .venv and run the main job on the embedded default
# CPU machines take the local CPU build of torch (pinned); on a GPU machine run
#   make setup TORCH="torch"   (or pre-install your CUDA torch into .venv).
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
export HF_HUB_OFFLINE := 1

.PHONY: setup test demo clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

test: setup
	TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider

# rCM on the embedded digits teacher (training/configs/digits.yaml), then the evaluation table:
# outputs/digits/{report.md,samples.png,pytorch_lora_weights.safetensors}. One torch thread: on a
# small shared CPU box more threads are slower, not faster (docs/benchmarks.md).
demo: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/accelerate launch --num_processes 1 --cpu --mixed_precision no --dynamo_backend no training/rcm.py
	OMP_NUM_THREADS=1 $(PY) training/eval_digits.py --threads 1 --student rcm=outputs/digits --student rcm-ema=outputs/digits/ema --out outputs/digits

clean:
	rm -rf $(VENV) outputs
