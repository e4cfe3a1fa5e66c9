#!/bin/bash
# Run 1 of the eighth session (one GPU), working tree on top of $1: the mask tile sweep
# (variants.py --mask, two interleaved rounds), then the mask / pack tests on the GPU.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SECONDS=0
timeout 330 python3 benchmarks/variants.py --mask --rounds 2 > $OUT/mask_sweep.txt 2>&1
echo "sweep rc=$? at ${SECONDS}s"; cat $OUT/mask_sweep.txt | cut -c1-400
timeout $((520 - SECONDS)) bash scripts/gpu_tests.sh -q -rs packages/cp-dcp/tests/ops/test_mask_empty_shards.py \
    packages/cp-dcp/tests/ops/test_a2a_kernels.py packages/cp-dcp/tests/ops/test_cuda_graph.py \
    packages/cp-dcp/tests/ops/test_properties.py > $OUT/gpu_tests_mask.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; tail -3 $OUT/gpu_tests_mask.txt
