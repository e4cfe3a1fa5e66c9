#!/bin/bash
# Run 5 of the eleventh session (one GPU), commit $1: the default-mode probe again, now also
# timing 255 new batch sizes (each a new call key: recorded on its first call).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
timeout 200 python3 benchmarks/auto_plans_probe.py --json $OUT/auto_plans-$1.json > $OUT/auto_plans-$1.txt 2>&1
echo "probe rc=$? at ${SECONDS}s"; cat $OUT/auto_plans-$1.json
