#!/bin/bash
# Run 5 of the fifth session: A/B of the unpack knobs (in-flight bytes 16 / 8 KiB per
# program, output stores write-back / .cs, both), B=4096 read-flush and B=1 / 64 graph replay.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout 400 python3 benchmarks/variants.py --ab --ab-only unpack-inflight,unpack-store,unpack-both > $OUT/ab_unpack.txt 2>&1
echo "ab rc=$?"; cat $OUT/ab_unpack.txt | tail -30
