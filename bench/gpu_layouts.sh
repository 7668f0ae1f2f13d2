#!/usr/bin/env bash
# bench/gpu_layouts.py on a GPU machine that has torch and transformers but nothing else of ours.
#   here:  bash bench/gpu_layouts.sh --fetch   downloads the duckdb and orjson wheels for the device's Python
#                                              (GPU_PYTHON, default 3.12) into .gpu/whl
#   there: bash bench/gpu_layouts.sh [ARGS]    with .gpu/whl carried along (the device tool: carry [".gpu/whl"]);
#                                              ARGS go to bench/gpu_layouts.py; the table lands in $OUT
set -eu
cd "$(dirname "$0")/.."
if [ "${1:-}" = --fetch ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${GPU_PYTHON:-3.12}" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .gpu/whl duckdb orjson
  ls .gpu/whl
  exit 0
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
W=$(mktemp -d)
for module in duckdb orjson; do
  if ! python3 -c "import $module" 2>/dev/null; then
    ls .gpu/whl/$module-*.whl >/dev/null 2>&1 || { echo "no $module here and no .gpu/whl/$module-*.whl:" \
      "run 'bash bench/gpu_layouts.sh --fetch' where pip reaches PyPI and carry .gpu/whl"; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$W/site" .gpu/whl/$module-*.whl
  fi
done
export PYTHONPATH="$W/site:${PYTHONPATH:-}"
python3 -c "import trainer.offline.loop" || { echo "the trainer does not import here (above: the module missing)"; exit 1; }
nvidia-smi -L 2>/dev/null || true
python3 bench/gpu_layouts.py --out "${OUT:-$W}" "$@"
