#!/bin/bash
# Run 5 of the sixth session (one GPU): the page of $1 (LSE math in the LSEs' own base), then the
# cp-dcp and cp-common GPU tests.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout 240 python3 benchmarks/run.py --commit "$1" --out $OUT/bench-h200.json --docs-dir $OUT/docs > $OUT/bench.txt 2>&1
echo "bench rc=$?"; tail -22 $OUT/bench.txt
timeout 300 bash scripts/gpu_tests.sh -q -rs packages/cp-dcp/tests packages/cp-common/tests > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc=$?"; tail -8 $OUT/gpu_tests.txt
