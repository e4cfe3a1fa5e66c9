#!/bin/bash
# Run 4 of the fifteenth session, on the two-GPU kind, commit 7798f0c: the group-memo tests again
# after mending test_group's count assertion (run 3's one failure), in their own process.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout 200 bash scripts/gpu_tests.sh -q -rs packages/cp-common/tests/test_group.py packages/cp-common/tests/test_identity_memo.py packages/cp-dcp/tests/test_groups.py > $OUT/gpu_tests_x2_group-7798f0c.txt 2>&1
tail -3 $OUT/gpu_tests_x2_group-7798f0c.txt
