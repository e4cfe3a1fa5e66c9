#!/bin/bash
# Run 1 of the sixth session: the tests of offsets past 2**31 elements, then the record-width
# forms of the unpack-combine (benchmarks/unpack_variants.py --family records), twice.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv > $OUT/gpu.txt
timeout 300 bash scripts/gpu_tests.sh -q -rs --durations=0 \
    packages/cp-dcp/tests/ops/test_large_offsets.py \
    packages/cp-common/tests/ops/test_merge_large_offsets.py > $OUT/gpu_tests_large.txt 2>&1
echo "large tests rc=$?"; tail -25 $OUT/gpu_tests_large.txt
for i in 1 2; do
    timeout 120 python3 benchmarks/unpack_variants.py --family records > $OUT/unpack_records_$i.txt 2>&1
    echo "records $i rc=$?"; grep -v '^check' $OUT/unpack_records_$i.txt | tail -8
    grep -c FAIL $OUT/unpack_records_$i.txt
done
