#!/bin/bash
# Run 1 of the fourteenth session (one GPU), commit $1: every GPU test of the four packages
# (one shared, weakly held CPGroup per process group; the launcher's type-tagged cache keys and
# narrower fallback; the demo stopping on a rank's exception; one seq_lens / query_start_loc
# check on every cp-dcp path), then the page (host rows: the resolve and launch paths changed).
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
timeout 270 python3 benchmarks/run.py --commit "$1" --out $OUT/bench-$1.json --docs-dir $OUT/docs \
    > $OUT/bench-$1.txt 2>&1
echo "page rc=$? at ${SECONDS}s"; grep -E "not met|incomplete|error" $OUT/docs/performance.md | head -20
