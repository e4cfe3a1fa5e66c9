#!/bin/bash
# Run 3 of the twenty-sixth session, on one H200, commit $1: run 2's page read the Python-path
# host rows 0.3-0.5x add_ higher than the committed page (624e703). host_profile.py, the page's
# tree (benchmarks/_ab_ref/s26ref = `git archive 624e703 packages/cp-common/src
# packages/cp-dcp/src`, carried) against this commit, interleaved A B A B (timings only; the
# launch plans' automatic build is not ready in these short processes: the Python path), then
# one cProfile of each tree.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
REF=benchmarks/_ab_ref/s26ref/packages
src_of() { if [ $1 = ref ]; then echo $REF/cp-common/src:$REF/cp-dcp/src; else
    echo packages/cp-common/src:packages/cp-dcp/src; fi; }
for round in 1 2; do
    for tree in ref head; do
        echo "== round $round, $tree" >> $OUT/host_ab-$1.txt
        PYTHONPATH=$(src_of $tree) timeout 90 python3 benchmarks/host_profile.py --no-profile \
            >> $OUT/host_ab-$1.txt 2>&1
        echo "host $tree round $round rc=$? at ${SECONDS}s"
    done
done
grep -vi warning $OUT/host_ab-$1.txt | head -80
for tree in ref head; do
    PYTHONPATH=$(src_of $tree) timeout 120 python3 benchmarks/host_profile.py \
        > $OUT/host_profile_$tree-$1.txt 2>&1
    echo "profile $tree rc=$? at ${SECONDS}s"
done
