#!/bin/bash
# Run 1 of the twentieth session, on the one-GPU kind, commit $1:
# 1. benchmarks/masked_copy.py on the new kernel and on the kernel before db6d0b1
#    (empty_shards-before-db6d0b1.py in this folder), interleaved twice;
# 2. every one-GPU test (scripts/gpu_tests.sh), after the masked LSE copy moved its select to
#    fp32 (db6d0b1) and the launch fast path's Triton range became 3.4 - 3.9.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
DIR=benchmarks/results/h200-2026-11-30-s20
SECONDS=0
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r packages /tmp/old/
cp $DIR/empty_shards-before-db6d0b1.py /tmp/old/packages/cp-dcp/src/cpattn_dcp/kernels/empty_shards.py
NEW=packages/cp-common/src:packages/cp-dcp/src:packages/cp-testing/src
OLD=/tmp/old/packages/cp-common/src:/tmp/old/packages/cp-dcp/src:/tmp/old/packages/cp-testing/src
for round in 1 2; do
  PYTHONPATH=$NEW timeout 120 python3 benchmarks/masked_copy.py --tag new-$round >> $OUT/masked_copy-$1.jsonl 2>> $OUT/masked_copy-$1.err
  PYTHONPATH=$OLD timeout 120 python3 benchmarks/masked_copy.py --tag old-$round >> $OUT/masked_copy-$1.jsonl 2>> $OUT/masked_copy-$1.err
done
echo "bench done at ${SECONDS}s"; wc -l $OUT/masked_copy-$1.jsonl; tail -3 $OUT/masked_copy-$1.err
timeout 260 bash scripts/gpu_tests.sh -q -rsfE packages/cp-dcp/tests > $OUT/gpu_tests-dcp-$1.txt 2>&1
echo "dcp tests rc=$? at ${SECONDS}s"; tail -1 $OUT/gpu_tests-dcp-$1.txt
timeout $((585 - SECONDS)) bash scripts/gpu_tests.sh -q -rsfE packages/cp-common/tests packages/cp-pcp/tests \
    packages/cp-testing/tests tests > $OUT/gpu_tests-rest-$1.txt 2>&1
echo "rest tests rc=$? at ${SECONDS}s"; tail -1 $OUT/gpu_tests-rest-$1.txt
grep -hE '^(FAILED|ERROR)' $OUT/gpu_tests-*-$1.txt | head
