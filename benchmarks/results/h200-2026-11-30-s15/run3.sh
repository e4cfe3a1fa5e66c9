#!/bin/bash
# Run 3 of the fifteenth session, on the two-GPU kind, commit $1: the nccl combine, direct-path,
# manager, group and PCP tests, the demo on 2 nccl ranks, then the two-GPU collectives
# (run.py --skip-kernels), the first since the ninth session's coll-x2-789e550.json.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu-x2.txt 2>&1
timeout 200 bash scripts/gpu_tests.sh -q -rs packages/cp-dcp/tests/distributed packages/cp-dcp/tests/direct \
    packages/cp-dcp/tests/test_manager.py packages/cp-pcp/tests packages/cp-common/tests/test_group.py \
    packages/cp-common/tests/test_capability.py packages/cp-dcp/tests/test_groups.py \
    > $OUT/gpu_tests_x2-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E '^(FAILED|ERROR)' $OUT/gpu_tests_x2-$1.txt | head -20
tail -2 $OUT/gpu_tests_x2-$1.txt
timeout 60 python3 -m cpattn_testing.demo --backend nccl --world-size 2 > $OUT/demo-x2-$1.txt 2>&1
echo "demo rc=$? at ${SECONDS}s"; tail -3 $OUT/demo-x2-$1.txt
timeout $((500 - SECONDS)) python3 benchmarks/run.py --skip-kernels --commit "$1" --time-budget 180 \
    --out $OUT/coll-x2-$1.json --docs-dir $OUT/docs > $OUT/coll-x2-$1.txt 2>&1
echo "collectives rc=$? at ${SECONDS}s"; grep -E 'A2A \(dcp_a2a_lse_reduce\).*graph' $OUT/docs/performance.md | head -8
