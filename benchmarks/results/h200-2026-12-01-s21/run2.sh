#!/bin/bash
# Run 2 of the twenty-first session (one GPU), commit $1: the unpack-combine with one 16-byte
# payload vector per thread and source at N=8 (twice tile_config's warps), against the shipped
# tile, through the op: benchmarks/variants.py --ab, switch unpack-onevec, three interleaved
# rounds (B=4096 read-flush timing; B=1/8/64 warm graph replay).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SECONDS=0
timeout 400 python3 benchmarks/variants.py --ab --ab-only unpack-onevec --rounds 3 \
    > $OUT/ab_unpack_onevec-$1.txt 2>&1
echo "ab rc=$? at ${SECONDS}s"; grep -v Warning $OUT/ab_unpack_onevec-$1.txt
