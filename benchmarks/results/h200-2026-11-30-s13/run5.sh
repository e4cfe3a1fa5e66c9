#!/bin/bash
# Run 5 of the thirteenth session, on the two-GPU kind, commit $1: the demo on 2 nccl ranks
# (now checking each combine's global LSE and every timed repeat bit for bit against the
# checked call: 20 repeats, so the direct path's later epochs too), its JSON; the nccl combine,
# direct-path and launcher tests; launch plans in their default mode.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
export CPATTN_CACHE_DIR=$(mktemp -d)
SECONDS=0
timeout 120 python3 -m cpattn_testing.demo --backend nccl --world-size 2 --json $OUT/demo-x2-$1.json \
    > $OUT/demo-x2-$1.txt 2>&1
echo "demo rc=$? at ${SECONDS}s"; tail -4 $OUT/demo-x2-$1.txt
timeout 240 bash scripts/gpu_tests.sh -q -rs packages/cp-dcp/tests/distributed packages/cp-dcp/tests/direct \
    packages/cp-testing/tests/test_launcher.py packages/cp-testing/tests/test_demo.py \
    > $OUT/gpu_tests_x2-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E '^(FAILED|ERROR)' $OUT/gpu_tests_x2-$1.txt | head -20
tail -2 $OUT/gpu_tests_x2-$1.txt
