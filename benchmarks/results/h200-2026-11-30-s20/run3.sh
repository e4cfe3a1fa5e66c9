#!/bin/bash
# Run 3 of the twentieth session, on the two-GPU kind, commit $1: the tests this session touched,
# on nccl at world size 2 (torch 2.11): the group memo tests (a barrier before destroying each
# subgroup), the compiled group tests (the equal-mesh case), and the combines' distributed
# tests (the AG combines' masked LSE copy now selects in fp32).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SECONDS=0
timeout 400 bash scripts/gpu_tests.sh -q -rsfE packages/cp-common/tests/test_group.py \
    packages/cp-common/tests/test_group_compile.py packages/cp-pcp/tests/test_group.py \
    packages/cp-dcp/tests/distributed/test_combine_dist.py \
    > $OUT/gpu_tests_x2-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; tail -1 $OUT/gpu_tests_x2-$1.txt
grep -E '^(FAILED|ERROR)' $OUT/gpu_tests_x2-$1.txt | head
