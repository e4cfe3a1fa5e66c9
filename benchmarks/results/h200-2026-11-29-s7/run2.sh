#!/bin/bash
# Run 2 of the seventh session, on the two-GPU kind, commit $1: the direct-path tests (the
# direct A2A combine now calls kernels.lse_math) on real ranks and simulated peers, the nccl
# combine tests, then the collectives with the CUDA-graph rows (run.py --skip-kernels).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used --format=csv > $OUT/gpu-x2.txt
env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)=' | sort > $OUT/env-x2.txt
SECONDS=0
timeout 300 bash scripts/gpu_tests.sh -q -rs --durations=10 packages/cp-dcp/tests/direct \
    packages/cp-dcp/tests/distributed packages/cp-dcp/tests/test_manager.py > $OUT/gpu_tests_x2.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E 'passed|failed|error' $OUT/gpu_tests_x2.txt | tail -3
grep -E '^(FAILED|ERROR)' $OUT/gpu_tests_x2.txt | head -20
timeout $((590 - SECONDS)) python3 benchmarks/run.py --skip-kernels --commit "$1" \
    --out $OUT/coll-x2-$1.json --docs-dir $OUT/docs > $OUT/coll-x2-$1.txt 2>&1
echo "collectives rc=$? at ${SECONDS}s"; grep -F '[graph]' $OUT/docs/performance.md | head -40
