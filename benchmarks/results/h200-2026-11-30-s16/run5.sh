#!/bin/bash
# Run 5 of the sixteenth session, on the two-GPU kind, commit $1: after the direct paths'
# sticky failure (publish and wait kernels read the error flag), the Triton >= 3.5 gate, the
# multicast env parsing, the group fallback wording and the A2A staging gap: the direct-path,
# manager, gather, nccl combine, capability, group and workspace tests, the demo on 2 nccl
# ranks, then the two-GPU collectives (the direct A2A rows show the cost of the flag loads).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
timeout 260 bash scripts/gpu_tests.sh -q -rsfE --durations=5 packages/cp-dcp/tests/direct \
    packages/cp-dcp/tests/test_manager.py packages/cp-dcp/tests/test_manager_validation.py \
    packages/cp-dcp/tests/test_gather.py packages/cp-dcp/tests/distributed \
    packages/cp-dcp/tests/ops/test_a2a_kernels.py packages/cp-common/tests/test_capability.py \
    packages/cp-common/tests/test_group.py packages/cp-common/tests/test_workspace.py \
    > $OUT/gpu_tests_x2-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E '^(FAILED|ERROR)' $OUT/gpu_tests_x2-$1.txt | head -20
tail -2 $OUT/gpu_tests_x2-$1.txt
timeout 60 python3 -m cpattn_testing.demo --backend nccl --world-size 2 > $OUT/demo-x2-$1.txt 2>&1
echo "demo rc=$? at ${SECONDS}s"; tail -2 $OUT/demo-x2-$1.txt
timeout $((420 - SECONDS)) python3 benchmarks/run.py --skip-kernels --commit "$1" --time-budget 60 \
    --out $OUT/coll-x2-$1.json --docs-dir $OUT/docs > $OUT/coll-x2-$1.txt 2>&1
echo "collectives rc=$? at ${SECONDS}s"
grep -E 'ours: direct A2A \[graph\] \| 2 \|' $OUT/docs/performance.md | head -12
