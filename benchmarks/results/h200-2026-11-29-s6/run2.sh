#!/bin/bash
# Run 2 of the sixth session, on the two-GPU kind: the whole GPU test suite (the multi-GPU
# tests included: direct A2A on real symmetric memory against NCCL A2A, 10 000 back-to-back
# calls, CUDA-graph replay across ranks; nccl ranks at world size 2).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used --format=csv > $OUT/gpu-x2.txt
nvidia-smi topo -m > $OUT/topo-x2.txt 2>&1
env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)=' | sort > $OUT/env-x2.txt
cat $OUT/gpu-x2.txt $OUT/env-x2.txt
timeout 540 bash scripts/gpu_tests.sh -q -rs --durations=25 > $OUT/gpu_tests_x2.txt 2>&1
echo "gpu tests rc=$?"; grep -E 'passed|failed|error' $OUT/gpu_tests_x2.txt | tail -5
grep -E '^(SKIPPED|FAILED|ERROR)' $OUT/gpu_tests_x2.txt | head -30
