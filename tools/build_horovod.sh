#!/usr/bin/env bash
# Build Horovod 0.28.1 from the PyPI sdist with the C++ standard raised to 17 (PyTorch 2.x needs it)
# into a wheel cached outside the repository, then install it into the given venv.
# A cached wheel is reused: the ~20 minute build runs only when no wheel is there.
set -euo pipefail

venv=${1:?usage: build_horovod.sh VENV}
version=0.28.1
py="$venv/bin/python"
# The cache key names the frameworks the extension was compiled against: their ABIs differ.
key=$("$py" -c 'import torch, tensorflow as tf; print(f"torch{torch.__version__}-tf{tf.__version__}".replace("+", "_"))' 2>/dev/null)
cache="${HOROVOD_WHEEL_CACHE:-$HOME/.cache/horovod-wheels}/$version-$key"
mkdir -p "$cache"

wheel=$(ls "$cache"/horovod-"$version"-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$wheel" ]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  echo "building horovod $version ($key) into $cache; this takes about 20 minutes on 2 cores"
  "$py" -m pip download --quiet --no-deps --no-binary :all: -d "$work" "horovod==$version"
  tar -xzf "$work"/horovod-"$version".tar.gz -C "$work"
  src="$work/horovod-$version"
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
    "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
  grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt"
  # CPU build with gloo: without HOROVOD_GPU_OPERATIONS, a CUDA toolkit found by CMake is unused.
  PATH="$venv/bin:$PATH" \
  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 \
  HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)" \
    "$py" -m pip wheel --no-build-isolation --no-deps -w "$work/dist" "$src"
  mv "$work"/dist/horovod-*.whl "$cache/"
  wheel=$(ls "$cache"/horovod-"$version"-*.whl | head -n 1)
fi

if ! "$venv/bin/horovodrun" --version >/dev/null 2>&1; then
  "$py" -m pip install --quiet --no-deps "$wheel"
fi
echo "horovod $version installed from $wheel"
