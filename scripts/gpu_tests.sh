#!/usr/bin/env bash
# GPU test run against the machine's installed CUDA torch/triton, no virtual environment.
# Used by `nox -s gpu_tests` and runnable as is on a GPU box without nox:
#   bash scripts/gpu_tests.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
# NVLink multicast stays off here and in every child process.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CPATTN_TEST_DEVICE=cuda
unset TRITON_INTERPRET
export PYTHONPATH="$PWD/packages/cp-common/src:$PWD/packages/cp-dcp/src:$PWD/packages/cp-pcp/src:$PWD/packages/cp-testing/src${PYTHONPATH:+:$PYTHONPATH}"
# A python without torch is a setup error, not a machine without a GPU (that read as a pass).
if ! python3 -c 'import torch, triton'; then
    echo "gpu_tests: $(command -v python3) cannot import torch and triton; run this with the" \
        "python of the machine's CUDA torch (not from a virtual environment without it)" >&2
    exit 1
fi
# So is a CPU-only torch (a venv from the CPU setup): neither a CUDA nor a ROCm build, so no
# GPU could ever be visible to it; only a GPU build without a visible device is a skip.
if ! python3 -c 'import sys, torch; sys.exit(0 if torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None else 1)'; then
    echo "gpu_tests: $(command -v python3) has a CPU-only torch" \
        "($(python3 -c 'import torch; print(torch.__version__)' 2>/dev/null || true): neither a CUDA" \
        "nor a ROCm build); run this with the python of the machine's CUDA torch (not from a" \
        "virtual environment with a CPU-only torch)" >&2
    exit 1
fi
if ! python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "SKIPPED gpu_tests: no CUDA device is visible to torch on this machine"
    exit 0
fi
python3 -c 'import torch, triton; print(f"gpu_tests: {torch.cuda.device_count()} x {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")'
if [ "$#" -eq 0 ]; then
    set -- -q -rs packages/cp-common/tests packages/cp-dcp/tests packages/cp-pcp/tests packages/cp-testing/tests
fi
exec python3 -m pytest -p no:cacheprovider "$@"
