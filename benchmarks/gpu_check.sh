#!/usr/bin/env bash
# The one GPU check of docs/benchmarks.md (JVP attention + 5 rCM iterations of Wan2.1-1.3B at 480p x 81 frames, and
# the model-FLOP utilisation those iterations reach, which rcm_diffusers.distill.cost assumes): at most 8 minutes,
# writes one JSON. Usage (repository root):
#   bash benchmarks/gpu_check.sh            # GPU; JSON in $OUT (device tool) or benchmarks/out/
#   bash benchmarks/gpu_check.sh --smoke    # CPU plumbing check at tiny sizes (CI: tests/test_real_arch.py)
#   bash benchmarks/gpu_check.sh --one-card # only the one-card section (fp8 base + block swap, 14B width)
# The device machine has torch/triton/transformers/accelerate/peft but no diffusers: carry its wheel
# (pure Python) in .whl/, prepared here with
#   echo /.whl/ >> "$(git rev-parse --git-path info/exclude)"
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl diffusers==0.42.1 importlib_metadata
# and run through the device tool with carry [".whl"] and: bash benchmarks/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
SMOKE=""
ONLY=""
for arg in "$@"; do
  case "$arg" in
    --smoke) SMOKE="--smoke" ;;
    --one-card) ONLY="--only one_card" ;;  # section 5 alone (fp8 base + block swap at the 14B width), whole budget
  esac
done
PY=${PYTHON:-python3}
DEST=${OUT:-benchmarks/out}
mkdir -p "$DEST"
if ! "$PY" -c "import diffusers" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "diffusers is not importable and no wheels were carried in .whl/ (see the header of $0)" >&2
    exit 2
  fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
[ -n "$SMOKE" ] && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# budget guard: the driver plans for 450 s, the hard stop is 480 s (8 min)
timeout -k 10 480 "$PY" benchmarks/gpu_check.py $SMOKE $ONLY --out "$DEST/gpu_check.json" --budget-s 450 2>&1 | tee "$DEST/gpu_check.log"
exit "${PIPESTATUS[0]}"
