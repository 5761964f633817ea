#!/usr/bin/env bash
# Collect, on a networked machine, every wheel the offline GPU check needs that a GPU image with
# torch in its system Python (CPython 3.12, manylinux x86_64, no network) lacks, into DIR:
# aitune's own members (built here), and their pure or binary dependencies for that Python.
# Then carry DIR to the GPU machine and run: python3 scripts/gpu_check.py --wheelhouse DIR
# WHEELHOUSE_PYTHON (default 3.12, the GPU image's) names another CPython, to rehearse the offline
# install in a CPU container whose Python differs.
set -euo pipefail
dir=${1:?usage: scripts/gpu_wheelhouse.sh DIR}
py=${WHEELHOUSE_PYTHON:-3.12}
cd "$(dirname "$0")/.."
mkdir -p "$dir"
python3 -m pip wheel --quiet --no-deps --wheel-dir "$dir" \
  ./aitune-core ./aitune-backend-inductor ./aitune-backend-torchao ./aitune-backend-onnxruntime \
  ./aitune-backend-tensorrt ./aitune-backend-torchtrt
# what torch's image does not bring: the plugin system, configs, the CLI's terminal, safetensors,
# torchao, ONNX export; and numpy, onnx and protobuf, which some torch images have and some lack:
# gpu_check.py installs those three only where the image cannot import them (torch, triton and
# typing_extensions are always the image's own)
python3 -m pip download --quiet --no-deps --dest "$dir" --only-binary=:all: \
  --python-version "$py" --implementation cp --abi "cp${py/./}" --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  pluggy attrs cattrs packaging rich markdown-it-py mdurl pygments typer click shellingham safetensors torchao \
  onnxscript onnx-ir ml_dtypes numpy onnx protobuf
du -sh "$dir"
size=$(du -sm "$dir" | cut -f1)
if [ "$size" -gt 60 ]; then
  echo "the wheelhouse is ${size} MiB, over the 60 MiB a GPU run may carry" >&2
  exit 1
fi
