#!/bin/bash
# Run 4 of the fifth session: the cache family again with int64 indexing (as shipped), twice;
# Nsight Compute on the shipped unpack, an elementwise copy kernel of the same bytes and a
# read-only reduction of the receive buffer (run 3's probe stopped at a wrong torch.sum call).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for i in 1 2; do
  timeout 200 python3 benchmarks/unpack_variants.py --family cache > $OUT/unpack_cache_i64_$i.txt 2>&1
  echo "unpack $i rc=$?"; grep -v "^check" $OUT/unpack_cache_i64_$i.txt | tail -6; grep -c FAIL $OUT/unpack_cache_i64_$i.txt
done
timeout 200 /usr/local/cuda/bin/ncu --nvtx --nvtx-include "probe/" --section SpeedOfLight \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \
    python3 benchmarks/unpack_variants.py --probe > $OUT/ncu.txt 2>&1
echo "ncu rc=$?"; grep -E "^  [a-zA-Z_]|dram__|Duration|DRAM Through|Memory Through" $OUT/ncu.txt
