#!/bin/bash
# Run 4 of the twenty-sixth session, on one H200, commit $1: run 3 again with launch plans off
# in both trees (CPATTN_LAUNCH_PLANS=0): in run 3 HEAD replayed the plans that run 2 had built,
# so it compared the replay with the Python path. The page's tree (624e703) against this
# commit, A B A B A B, then a cProfile of each tree.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CPATTN_LAUNCH_PLANS=0
SECONDS=0
REF=benchmarks/_ab_ref/s26ref/packages
src_of() { if [ $1 = ref ]; then echo $REF/cp-common/src:$REF/cp-dcp/src; else
    echo packages/cp-common/src:packages/cp-dcp/src; fi; }
for round in 1 2 3; do
    for tree in ref head; do
        echo "== round $round, $tree" >> $OUT/host_ab_py-$1.txt
        PYTHONPATH=$(src_of $tree) timeout 90 python3 benchmarks/host_profile.py --no-profile \
            >> $OUT/host_ab_py-$1.txt 2>&1
        echo "host $tree round $round rc=$? at ${SECONDS}s"
    done
done
grep -vi warning $OUT/host_ab_py-$1.txt | head -80
for tree in ref head; do
    PYTHONPATH=$(src_of $tree) timeout 120 python3 benchmarks/host_profile.py \
        > $OUT/host_profile_py_$tree-$1.txt 2>&1
    echo "profile $tree rc=$? at ${SECONDS}s"
done
