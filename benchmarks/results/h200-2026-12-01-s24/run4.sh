#!/bin/bash
# Run 4 of the twenty-fourth session (one GPU), commit $1: run 3 again with launch plans on
# from import (CPATTN_LAUNCH_PLANS=1: run 3's host_profile.py calls took the Python path, the
# auto build not being ready), last page's tree f4d7212 against this commit, A B A B A B.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CPATTN_LAUNCH_PLANS=1
SECONDS=0
REF=benchmarks/_ab_ref/s24ref/packages
for round in 1 2 3; do
    for tree in ref head; do
        if [ $tree = ref ]; then src=$REF/cp-common/src:$REF/cp-dcp/src; else
            src=packages/cp-common/src:packages/cp-dcp/src; fi
        echo "== round $round, $tree" >> $OUT/host_plans_ab-$1.txt
        PYTHONPATH=$src timeout 120 python3 benchmarks/host_profile.py --no-profile \
            >> $OUT/host_plans_ab-$1.txt 2>&1
        echo "host $tree round $round rc=$? at ${SECONDS}s"
    done
done
grep -vi warning $OUT/host_plans_ab-$1.txt | head -80
