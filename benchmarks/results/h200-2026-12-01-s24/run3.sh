#!/bin/bash
# Run 3 of the twenty-fourth session (one GPU), commit $1: eager host time with launch plans
# on (the default), the last page's tree (f4d7212; benchmarks/_ab_ref/s24ref = `git archive
# f4d7212 packages/cp-common/src packages/cp-dcp/src`, carried) against this commit,
# interleaved A B A B (runs 1-2 read the unpack's replay at 1.55-1.64x add_, the last page
# 1.42-1.44x); then the GPU tests of cp-common, cp-pcp and cp-testing, and the sm_90 compile
# test (fixed after run 2).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
REF=benchmarks/_ab_ref/s24ref/packages
for round in 1 2; do
    for tree in ref head; do
        if [ $tree = ref ]; then src=$REF/cp-common/src:$REF/cp-dcp/src; else
            src=packages/cp-common/src:packages/cp-dcp/src; fi
        echo "== round $round, $tree" >> $OUT/host_ab-$1.txt
        PYTHONPATH=$src timeout 90 python3 benchmarks/host_profile.py --no-profile \
            >> $OUT/host_ab-$1.txt 2>&1
        echo "host $tree round $round rc=$? at ${SECONDS}s"
    done
done
grep -vi warning $OUT/host_ab-$1.txt | head -60
timeout $((590 - SECONDS)) bash scripts/gpu_tests.sh -q -rsfE --durations=5 \
    packages/cp-common/tests packages/cp-pcp/tests packages/cp-testing/tests \
    packages/cp-dcp/tests/ops/test_kernels_compile.py \
    > $OUT/gpu_tests-rest-$1.txt 2>&1
echo "rest tests rc=$? at ${SECONDS}s"; tail -1 $OUT/gpu_tests-rest-$1.txt
grep -hE '^(FAILED|ERROR)' $OUT/gpu_tests-rest-$1.txt | head
