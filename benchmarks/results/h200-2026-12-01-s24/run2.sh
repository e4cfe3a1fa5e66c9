#!/bin/bash
# Run 2 of the twenty-fourth session (one GPU), commit $1: the page's kernel and host rows
# again (run 1's page read the unpack's host time with plans on at 1.59-1.64x add_, where the
# replay path did not change since the last page's 1.42-1.44x), then the cp-dcp GPU tests.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
timeout 200 python3 benchmarks/run.py --commit "$1" --out $OUT/bench2-$1.json \
    --docs-dir $OUT/docs > $OUT/bench2-$1.txt 2>&1
echo "page rc=$? at ${SECONDS}s"; grep -E "not met|incomplete|error" $OUT/docs/performance.md | head -20
grep -E "a2a_unpack_combine" $OUT/docs/performance.md | head -8
timeout $((590 - SECONDS)) bash scripts/gpu_tests.sh -q -rsfE --durations=5 packages/cp-dcp/tests \
    > $OUT/gpu_tests-dcp-$1.txt 2>&1
echo "dcp tests rc=$? at ${SECONDS}s"; tail -1 $OUT/gpu_tests-dcp-$1.txt
grep -hE '^(FAILED|ERROR)' $OUT/gpu_tests-dcp-$1.txt | head
