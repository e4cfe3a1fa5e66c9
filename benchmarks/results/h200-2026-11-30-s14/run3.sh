#!/bin/bash
# Run 3 of the fourteenth session (one GPU), commit $1: the host time of every op, the
# previous session's last commit (185a200, exported to benchmarks/_ab_ref/185a200 and carried)
# against this tree, in alternating processes, launch plans off and on, three rounds
# (benchmarks/host_profile.py --no-profile: best of 3 loops of 3000 calls per case). Run 1's page
# showed higher host ratios to add_ than the thirteenth session's page, on a slower host.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CPATTN_CACHE_DIR=$(mktemp -d)
src() { echo "$1/cp-common/src:$1/cp-dcp/src:$1/cp-pcp/src:$1/cp-testing/src"; }
OLD=$(src benchmarks/_ab_ref/185a200/packages); NEW=$(src packages)
SECONDS=0
for round in 1 2 3; do
  for tree in old new; do
    for plans in 0 auto; do
      pp=$OLD; [ $tree = new ] && pp=$NEW
      echo "== round $round tree $tree plans $plans"
      CPATTN_LAUNCH_PLANS=$plans PYTHONPATH=$pp timeout 150 python3 benchmarks/host_profile.py \
          --no-profile --calls 3000 2>&1 | grep -v Warning
    done
  done
done > $OUT/host_ab-$1.txt
echo "done at ${SECONDS}s"
python3 - $OUT/host_ab-$1.txt <<'PY'
import collections, re, statistics, sys
rows = collections.defaultdict(list)
tag = None
for line in open(sys.argv[1]):
    m = re.match(r"== round \d+ tree (\w+) plans (\w+)", line)
    if m:
        tag = (m[1], m[2]); continue
    m = re.match(r"(.+?)\s+([\d.]+) us/call", line)
    if m and tag:
        rows[(m[1].strip(), tag[1], tag[0])].append(float(m[2]))
names = sorted({k[0] for k in rows})
for name in names:
    for plans in ("0", "auto"):
        o, n = rows.get((name, plans, "old"), []), rows.get((name, plans, "new"), [])
        if o and n:
            print(f"{name:30s} plans={plans:4s} old {min(o):7.2f} {statistics.median(o):7.2f}  new {min(n):7.2f} {statistics.median(n):7.2f}  new/old(min) {min(n)/min(o):.3f}")
PY
