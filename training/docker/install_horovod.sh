#!/usr/bin/env bash
# Build Horovod 0.28.1 with NCCL GPU operations into the active Python environment (Docker build).
# Shared by the framework images; the caller sets HOROVOD_WITH_PYTORCH=1 and/or
# HOROVOD_WITH_TENSORFLOW=1 and HOROVOD_BUILD_CUDA_CC_LIST (GPU architectures to compile).
#
# Why each step:
#  * 0.28.1 is Horovod's last release. Its CMake asks for C++14; PyTorch 2.x and TensorFlow
#    2.15 headers need C++17, so the standard is raised to 17 (also for the CUDA kernels).
#  * NCCL comes from the framework's own nvidia-nccl wheel, linked shared: one NCCL in the
#    process, the version the framework was tested with, and NCCL_* settings apply to both.
#  * The build machine has no GPU driver: libcuda is resolved from the toolkit's stubs during
#    the build only (Horovod's reference Dockerfile does the same).
#  * gloo is built in as the CPU fallback controller; there is no MPI in these images, jobs
#    are launched with `horovodrun --gloo` over SSH.
set -euo pipefail

version=0.28.1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

python -m pip download --no-deps --no-binary :all: -d "$work" "horovod==$version"
tar -xzf "$work/horovod-$version.tar.gz" -C "$work"
src="$work/horovod-$version"
sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
sed -i -E 's/set\(CMAKE_CUDA_STANDARD 1[14]\)/set(CMAKE_CUDA_STANDARD 17)/' "$src/horovod/common/ops/cuda/CMakeLists.txt"
sed -i "s/'--std=c++11'/'--std=c++17'/" "$src/cmake/build_utils.py"
grep -q 'CMAKE_CXX_STANDARD 17' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
grep -q "'--std=c++17'" "$src/cmake/build_utils.py"

nccl=$(python -c 'import importlib.util; print(importlib.util.find_spec("nvidia.nccl").submodule_search_locations[0])')
ln -sf libnccl.so.2 "$nccl/lib/libnccl.so"  # the wheel ships only the SONAME; the linker wants libnccl.so

ldconfig /usr/local/cuda/lib64/stubs
HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_LINK=SHARED \
HOROVOD_NCCL_INCLUDE="$nccl/include" HOROVOD_NCCL_LIB="$nccl/lib" \
HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_MXNET=1 \
MAKEFLAGS="-j$(nproc)" \
  python -m pip install --no-cache-dir --no-build-isolation --no-deps "$src"
horovodrun --check-build | tee "$work/check-build.txt"
ldconfig  # drop the stubs again: at run time the node's driver provides libcuda
grep -q '\[X\] NCCL' "$work/check-build.txt"
