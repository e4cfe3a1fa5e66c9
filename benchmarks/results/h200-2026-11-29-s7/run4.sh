#!/bin/bash
# Run 4 of the seventh session (one GPU), commit $1 (the A2A block format): the op tests on the
# GPU (A2A kernels and layouts at the exact H=64 D=128 N=2 B=4096 shape, properties, offsets
# past 2**31, CUDA graphs, correct_attn_out), then the page.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SECONDS=0
timeout 280 bash scripts/gpu_tests.sh -q -rs packages/cp-dcp/tests/ops packages/cp-dcp/tests/test_manager.py \
    > $OUT/gpu_tests_ops-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E '^(FAILED|ERROR)' $OUT/gpu_tests_ops-$1.txt | head -20
tail -2 $OUT/gpu_tests_ops-$1.txt
timeout $((590 - SECONDS)) python3 benchmarks/run.py --commit "$1" --out $OUT/bench-$1.json \
    --docs-dir $OUT/docs > $OUT/bench-$1.txt 2>&1
echo "page rc=$? at ${SECONDS}s"; grep -E '^\| `(a2a|correct)' $OUT/docs/performance.md | head -20
grep -E '^\| cp-dcp A2A' $OUT/docs/performance.md
