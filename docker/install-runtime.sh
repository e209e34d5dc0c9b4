#!/bin/sh
# Installs the runtime into /opt/ddpack/venv. Run by both Dockerfiles in the dependency layer, so a
# change to trainer code never reinstalls torch.
#   $1: torch requirement (e.g. torch==2.13.0+cpu)   $2: pip index URL for torch ("" = pip's default)
#   $3: the build this image must end up with: cpu or cuda (checked, so a wrong wheel fails the build)
# A CA bundle mounted as a BuildKit secret (id=pip_cert) is used for TLS and never stored in a layer;
# wheels in /wheelhouse (a bind mount) are preferred, for hosts without the package index.
set -eu
torch_req=$1
torch_index=${2:-}
expect=${3:-cpu}
case "${torch_req}" in
torch== | torch==+*)
  echo "ddpack: no torch version given; build with make image, which passes --build-arg TORCH_VERSION" >&2
  exit 2
  ;;
esac

if [ -s /run/secrets/pip_cert ]; then
  export PIP_CERT=/run/secrets/pip_cert
fi
find_links=""
if ls /wheelhouse/*.whl >/dev/null 2>&1; then
  find_links="--find-links /wheelhouse"
fi
pip="/opt/ddpack/venv/bin/pip --no-cache-dir --disable-pip-version-check"

python3 -m venv /opt/ddpack/venv
if [ -n "$torch_index" ]; then
  # torch alone from its own index (the CPU build lives there); its dependencies from the default index.
  # shellcheck disable=SC2086
  $pip install --no-deps --index-url "$torch_index" $find_links ${PIP_EXTRA_ARGS:-} "$torch_req"
fi
# shellcheck disable=SC2086
$pip install $find_links ${PIP_EXTRA_ARGS:-} "$torch_req" numpy
/opt/ddpack/venv/bin/python - "$expect" <<'PY'
import sys
import numpy
import torch
import torch.distributed as dist

expect = sys.argv[1]
print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", dist.is_nccl_available(), "numpy", numpy.__version__)
if expect == "cuda" and not (torch.version.cuda and dist.is_nccl_available()):
    sys.exit(f"install-runtime: expected a CUDA build of torch with NCCL, got {torch.__version__}")
if expect == "cpu" and torch.version.cuda:
    sys.exit(f"install-runtime: expected the CPU build of torch, got {torch.__version__} (CUDA {torch.version.cuda})")
PY

# The bundle's code is copied to /opt/ddpack/lib in a later layer; a .pth file puts it on the venv's path.
site=$(/opt/ddpack/venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo /opt/ddpack/lib > "$site/ddpack.pth"
mkdir -p /opt/ddpack/lib
# entrypoint on the PATH that a login shell keeps (/usr/local/bin), bound to the venv's interpreter.
printf '#!/opt/ddpack/venv/bin/python\nimport sys\nfrom entrypoint.cli import main\nsys.exit(main())\n' > /usr/local/bin/entrypoint
chmod 0755 /usr/local/bin/entrypoint
# Trim what no runtime here loads (KEEP_DEV_FILES=1 keeps it): torch's CMake files, the test suites packages
# ship, and torch's C++ test executables (torch/test and bin/test_*, gtest programs no Python code runs;
# ~125 MB in the CPU wheel); and torch's C++ headers where the image has no compiler (WITH_COMPILER=0):
# only torch.compile's code generation and C++ extension builds read them. Under pyxis every file and
# every byte costs start time: enroot unpacks the whole image on every node for every job (bench/bench_start.py).
if [ "${KEEP_DEV_FILES:-0}" != 1 ]; then
  if [ "${WITH_COMPILER:-1}" != 1 ]; then
    rm -rf "$site/torch/include"
  fi
  rm -rf "$site/torch/share/cmake" "$site/torch/test"
  if [ -d "$site/torch/bin" ]; then
    find "$site/torch/bin" -maxdepth 1 -type f \( -name 'test_*' -o -name '*Test' \) -exec rm -f {} +
  fi
  find "$site" -depth -type d -name tests -prune -exec rm -rf {} +
fi
# Bytecode compiled once here, for the venv and the interpreter's standard library (python:*-slim ships
# none), so no rank of a fresh container compiles torch's modules again at import.
find /opt/ddpack -name __pycache__ -prune -exec rm -rf {} +
stdlib=$(/opt/ddpack/venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
# A file that does not compile (test data with deliberate syntax errors) stays source-only.
/opt/ddpack/venv/bin/python -m compileall -q -j 0 "$site" "$stdlib" >/dev/null || true
# Any uid (pyxis runs tasks as the submitting user) must be able to read and run everything.
chmod -R a+rX /opt/ddpack
