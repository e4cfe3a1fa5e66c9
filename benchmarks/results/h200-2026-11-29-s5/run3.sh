#!/bin/bash
# Run 3 of the fifth session: unpack cache-modifier forms (run 2's attempt stopped at a
# ptxas error: .cg loads cannot take an L1 evict_first policy), then Nsight Compute on the
# shipped unpack, a same-size copy and a read-only reduction of the receive buffer.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
uptime
timeout 240 python3 benchmarks/unpack_variants.py --family cache > $OUT/unpack_cache.txt 2>&1
echo "unpack rc=$?"; grep -v "^check" $OUT/unpack_cache.txt | tail -8; grep -c FAIL $OUT/unpack_cache.txt
timeout 240 /usr/local/cuda/bin/ncu --nvtx --nvtx-include "probe/" --section SpeedOfLight \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \
    python3 benchmarks/unpack_variants.py --probe > $OUT/ncu.txt 2>&1
echo "ncu rc=$?"; grep -E "^  [a-z_]|dram__|Duration|DRAM Through|Memory Through" $OUT/ncu.txt
