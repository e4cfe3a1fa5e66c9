#!/bin/bash
# Run 1 of the twenty-second session (one GPU), commit $1: the GPU tests of cp-common and
# cp-dcp (the review fixes: probe agreement, forced gathers, device and negative-bit checks),
# then the eager host time of the ops with launch plans off (the Python checks the fixes
# touched), this commit against the session's start (benchmarks/_ab_ref/s22start = `git
# archive beabd4b packages/cp-common/src packages/cp-dcp/src`, carried), interleaved A B A B.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SECONDS=0
timeout 420 bash scripts/gpu_tests.sh -q -rsfE --durations=5 packages/cp-common/tests \
    packages/cp-dcp/tests > $OUT/gpu_tests-common-dcp-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; tail -1 $OUT/gpu_tests-common-dcp-$1.txt
grep -hE '^(FAILED|ERROR)' $OUT/gpu_tests-common-dcp-$1.txt | head
REF=benchmarks/_ab_ref/s22start/packages
for round in 1 2; do
    for tree in start head; do
        if [ $tree = start ]; then src=$REF/cp-common/src:$REF/cp-dcp/src; else
            src=packages/cp-common/src:packages/cp-dcp/src; fi
        echo "== round $round, $tree" >> $OUT/host_ab-$1.txt
        CPATTN_LAUNCH_PLANS=0 PYTHONPATH=$src timeout 90 python3 benchmarks/host_profile.py \
            --no-profile >> $OUT/host_ab-$1.txt 2>&1
        echo "host $tree round $round rc=$? at ${SECONDS}s"
    done
done
grep -vi warning $OUT/host_ab-$1.txt | head -60
