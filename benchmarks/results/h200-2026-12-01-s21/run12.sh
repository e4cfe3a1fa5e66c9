#!/bin/bash
# Run 12 of the twenty-first session (one GPU), commit $1: the unpack's payload loads with
# eviction_policy="evict_first" (this commit) against the same kernel without it
# (benchmarks/_ab_ref/a2a.py = `git show 3de8839:packages/cp-dcp/src/cpattn_dcp/kernels/a2a.py`,
# carried), both with one vector per thread at N=8, every page shape at B=4096; then
# variants.py --ab unpack-evict for the decode sizes (warm graph replay, B = 1, 8, 64).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SECONDS=0
timeout 200 python3 benchmarks/unpack_asm.py --ref-kernel benchmarks/_ab_ref/a2a.py --rounds 3 \
    --shapes 8,8,128 4,16,128 2,32,128 8,8,256 4,16,256 2,32,256 8,16,512 4,32,512 2,64,512 \
    --only '^ref kernel one-vector' > $OUT/unpack_ab_evict-$1.txt 2>&1
echo "evict rc=$? at ${SECONDS}s"; grep -v Warning $OUT/unpack_ab_evict-$1.txt | grep -v "^check ok"
timeout 120 python3 benchmarks/variants.py --ab --ab-only unpack-evict --rounds 2 \
    > $OUT/ab_unpack_evict-$1.txt 2>&1
echo "ab rc=$? at ${SECONDS}s"; grep -v Warning $OUT/ab_unpack_evict-$1.txt
