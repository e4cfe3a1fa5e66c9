#!/bin/bash
# Run 1 of the seventeenth session, on the two-GPU kind, commit $1: can two ubatches on two
# streams starve each other's publishes (two_streams.py)? Then the new allocation-agreement
# tests (one rank stubbed out of memory, a real 1 PiB request) and the manager tests.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
timeout 300 python3 benchmarks/results/h200-2026-11-30-s17/two_streams.py $OUT/two_streams-$1.json \
    > $OUT/two_streams-$1.txt 2>&1
echo "two_streams rc=$? at ${SECONDS}s"; cat $OUT/two_streams-$1.txt | cut -c1-250 | tail -30
timeout $((540 - SECONDS)) bash scripts/gpu_tests.sh -q -rsfE --durations=5 \
    packages/cp-common/tests/test_workspace.py packages/cp-dcp/tests/test_manager.py \
    > $OUT/gpu_tests_alloc-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E '^(FAILED|ERROR)' $OUT/gpu_tests_alloc-$1.txt | head -20
tail -3 $OUT/gpu_tests_alloc-$1.txt
