#!/bin/bash
# Run 2 of the fifteenth session (one GPU), commit $1: every GPU test of the four packages
# (the shared index-dtype rule; build_mixed_decode_subset's int64 arithmetic for uint16/32/64;
# the review fixes of the session), then the page, then the unpack TMA forms at H=128 D=512
# (run 1 stopped before that shape).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
timeout 300 bash scripts/gpu_tests.sh -q -rs --durations=5 packages/cp-dcp/tests \
    > $OUT/gpu_tests-dcp-$1.txt 2>&1 &
A=$!
timeout 300 bash scripts/gpu_tests.sh -q -rs --durations=5 packages/cp-common/tests \
    packages/cp-pcp/tests packages/cp-testing/tests > $OUT/gpu_tests-rest-$1.txt 2>&1 &
B=$!
wait $A; echo "cp-dcp rc=$? at ${SECONDS}s"; tail -1 $OUT/gpu_tests-dcp-$1.txt
wait $B; echo "rest rc=$? at ${SECONDS}s"; tail -1 $OUT/gpu_tests-rest-$1.txt
grep -hE "^(FAILED|ERROR)" $OUT/gpu_tests-*-$1.txt | head -30
timeout 200 python3 benchmarks/run.py --commit "$1" --out $OUT/bench-$1.json --docs-dir $OUT/docs \
    > $OUT/bench-$1.txt 2>&1
echo "page rc=$? at ${SECONDS}s"; grep -E "not met|incomplete|error" $OUT/docs/performance.md | head -20
timeout $((570 - SECONDS)) python3 benchmarks/unpack_tma.py --rounds 2 --shapes 8,16,512 \
    > $OUT/unpack_tma_d512-$1.txt 2>&1
echo "tma rc=$? at ${SECONDS}s"; grep -v Warning $OUT/unpack_tma_d512-$1.txt | tail -25
