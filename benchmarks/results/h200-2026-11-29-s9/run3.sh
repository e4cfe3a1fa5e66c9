#!/bin/bash
# Run 3 of the ninth session, on the two-GPU kind, commit $1: the nccl combine, direct-path,
# manager and PCP tests, the demo on 2 nccl ranks, then the collectives (run.py
# --skip-kernels). First two-GPU run after the op-registration refactors (99afb80, 33ccc83) and
# the merge's EAGER rule for tiles of several heads.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SECONDS=0
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu-x2.txt 2>&1
timeout 200 bash scripts/gpu_tests.sh -q -rs packages/cp-dcp/tests/distributed packages/cp-dcp/tests/direct \
    packages/cp-dcp/tests/test_manager.py packages/cp-pcp/tests > $OUT/gpu_tests_x2-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E '^(FAILED|ERROR)' $OUT/gpu_tests_x2-$1.txt | head -20
tail -2 $OUT/gpu_tests_x2-$1.txt
timeout 60 python3 -m cpattn_testing.demo --backend nccl --world-size 2 > $OUT/demo-x2-$1.txt 2>&1
echo "demo rc=$? at ${SECONDS}s"; tail -3 $OUT/demo-x2-$1.txt
timeout $((440 - SECONDS)) python3 benchmarks/run.py --skip-kernels --commit "$1" --time-budget 150 \
    --out $OUT/coll-x2-$1.json --docs-dir $OUT/docs > $OUT/coll-x2-$1.txt 2>&1
echo "collectives rc=$? at ${SECONDS}s"; grep -E 'A2A \(dcp_a2a_lse_reduce\).*graph' $OUT/docs/performance.md | head -8
