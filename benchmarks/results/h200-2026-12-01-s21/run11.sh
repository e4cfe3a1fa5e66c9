#!/bin/bash
# Run 11 of the twenty-first session (one GPU), commit $1: the shipped unpack (one vector per
# thread at N=8, weights just before their sums) next to plain-Triton forms of the same kernel
# with other one-vector tiles (4 rows / 2 warps, 16 / 8, 32 / 16) and, per tile, payload loads
# with evict_first or output stores with .cs; H=64 N=8 D=128 and 256, B=4096, five rounds.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SECONDS=0
timeout 300 python3 benchmarks/unpack_asm.py --rounds 5 --shapes 8,8,128 8,8,256 \
    --only '^triton r(4 w2|8 w4|16 w8|32 w16)( evict-first| \.cs)?$' \
    > $OUT/unpack_tiles_n8-$1.txt 2>&1
echo "tiles rc=$? at ${SECONDS}s"; grep -v Warning $OUT/unpack_tiles_n8-$1.txt | grep -v "^check ok"
