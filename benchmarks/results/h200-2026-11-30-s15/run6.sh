#!/bin/bash
# Run 6 of the fifteenth session (one GPU), commit 72bce66: the direct-path, manager and gather
# tests after wait_and_combine's closed check (e0c00d8).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout 280 bash scripts/gpu_tests.sh -q -rs packages/cp-dcp/tests/direct packages/cp-dcp/tests/test_manager.py packages/cp-dcp/tests/test_manager_validation.py packages/cp-dcp/tests/test_gather.py > $OUT/gpu_tests-direct-72bce66.txt 2>&1
echo rc=$?; tail -2 $OUT/gpu_tests-direct-72bce66.txt
