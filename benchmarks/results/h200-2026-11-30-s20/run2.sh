#!/bin/bash
# Run 2 of the twentieth session, on the one-GPU kind, commit $1: the cp-dcp one-GPU tests alone
# (run 1 gave them 260 s after its benchmark; they stopped at 87% with no failure).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SECONDS=0
timeout 570 bash scripts/gpu_tests.sh -q -rsfE --durations=5 packages/cp-dcp/tests \
    > $OUT/gpu_tests-dcp-$1.txt 2>&1
echo "dcp tests rc=$? at ${SECONDS}s"; tail -1 $OUT/gpu_tests-dcp-$1.txt
grep -hE '^(FAILED|ERROR)' $OUT/gpu_tests-dcp-$1.txt | head
