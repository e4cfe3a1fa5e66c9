#!/bin/bash
# Run 1 of the fifth session: host-time breakdown of the eager ops, then the persistent
# unpack-combine forms (register prefetch / tl.range stages) against the shipped kernel.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nproc; uptime
timeout 120 python3 benchmarks/host_profile.py --breakdown > $OUT/host_breakdown.txt 2>&1
echo "host rc=$?"; cat $OUT/host_breakdown.txt
timeout 420 python3 benchmarks/unpack_variants.py --family persist > $OUT/unpack_persist.txt 2>&1
echo "unpack rc=$?"; grep -v "^check" $OUT/unpack_persist.txt; grep -c FAIL $OUT/unpack_persist.txt
