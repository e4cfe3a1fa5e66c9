#!/bin/bash
# Run 4 of the sixth session, on the two-GPU kind: the collectives again with the CUDA-graph
# rows (benchmarks/run.py --skip-kernels at $1).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout 420 python3 benchmarks/run.py --skip-kernels --commit "$1" --out $OUT/coll-x2.json \
    --docs-dir $OUT/docs > $OUT/coll-x2.txt 2>&1
echo "collectives rc=$?"; grep -v 'not measured' $OUT/coll-x2.txt | tail -12
grep -F '[graph]' $OUT/docs/performance.md | head -70
