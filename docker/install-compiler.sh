#!/bin/sh
# A C++ compiler for torch.compile, in its own layer below torch's: inductor generates C++ for CPU
# kernels and builds it with g++ (without one the first compiled step fails with InvalidCxxCompiler),
# and on GPU Triton builds its kernel launcher with the same compiler against Python's headers. Also
# what users' C++ extensions (torch.utils.cpp_extension.load_inline) need. The headers come with the
# python:*-slim bases; Debian's python3-dev adds them to a Debian-archive base. torch's own C++
# headers stay in the image when this layer is there (install-runtime.sh, WITH_COMPILER).
set -eu
include=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
packages="g++"
if [ ! -f "$include/Python.h" ]; then
  packages="$packages python3-dev"
fi
# What no build here reads never lands (dpkg path excludes for this install; under pyxis every file and
# byte is unpacked on every node for every job, bench/bench_sqsh.py --against): documentation, man and
# info pages, message translations (gcc's alone are 47 MB), gcc's link-time optimiser (lto1: inductor
# and Triton never pass -flto) and the sanitizer runtimes (only -fsanitize links them).
cat > /etc/dpkg/dpkg.cfg.d/ddpack-compiler-excludes <<'EXCLUDES'
path-exclude=/usr/share/doc/*
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
path-exclude=/usr/share/locale/*
path-exclude=/usr/share/lintian/*
path-exclude=/usr/lib/gcc/x86_64-linux-gnu/*/lto1
path-exclude=/usr/lib/gcc/aarch64-linux-gnu/*/lto1
path-exclude=/usr/lib/*-linux-gnu/lib*san.so*
path-exclude=/usr/lib/gcc/*-linux-gnu/*/lib*san*.a
EXCLUDES
apt-get update -qq
# shellcheck disable=SC2086
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $packages >/dev/null
rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb /etc/dpkg/dpkg.cfg.d/ddpack-compiler-excludes
echo "install-compiler: $(g++ --version | head -1); Python headers in $include"
test -f "$include/Python.h"
