"""The performance targets the page reports as met / not met (issues 3 and 5).

- Bandwidth (issue 3 for the merge, issue 5 for the cp-dcp kernels): at B = 4096, bf16, for
  H=128/D=512 (MLA decode) and H=64/D=128 (GQA), N in {2, 4, 8}: achieved bytes/s >= 85% of
  the device-to-device copy bandwidth measured in the same run.
- Decode latency (issue 5): B in {1, 8, 64}, timed under CUDA-graph replay, within 1.5x of an
  empty Triton kernel's replay time (same number of calls per graph). Two further readings,
  reported next to the literal one and labelled as such: against the larger of the empty
  kernel and the bytes at the copy bandwidth, and against a device copy of the same bytes
  replayed the same way (``size_copy_ratio >= 1 / 1.5``: our time <= 1.5x the copy's).
- Host overhead: issue 3 asks for a cached launch path costing <= 10 µs of host time per
  launch (judged on ``launch_cached`` of an empty kernel); issue 5 asks for <= 10 µs per eager
  call of the cp-dcp ops; the merge op is held to the same rule (beyond issue 3). The machine
  notes say host targets are judged against a plain torch op of the same run, so a row also
  passes at <= 1.5x the host time of an eager ``torch.Tensor.add_`` (timed in the same rounds
  as the op: ``cpattn_testing.bench.measure_host_rounds``). A second reading, labelled as
  such, compares each op that allocates its output (all but the in-place mask), on the default
  path, with an out-of-place ``torch.add`` (a torch op that allocates its output) timed in
  those rounds too.
  The ops' rows are timed twice: with launch plans on (``cpattn_common.launch_plans``: repeated
  calls of one argument layout replay natively; the default on a GPU machine with a C++
  compiler), rows ``<kernel> [plans]``, which issue 5's host target judges; and on the Python
  path (plans off, ``CPATTN_LAUNCH_PLANS=0``), judged by the same rule and labelled as such.
"""

from __future__ import annotations

from typing import Any

from cpattn_testing.bench import Target

HEAD_SHAPES: tuple[tuple[int, int], ...] = ((128, 512), (64, 128))
MASK_SHAPES: tuple[tuple[int, int], ...] = ((128, 0), (64, 0))
ALL_N: tuple[int, ...] = (2, 4, 8)
DECODE_B: tuple[int, ...] = (1, 8, 64)
COPY_FRACTION = 0.85
DECODE_RATIO = 1.5
HOST_US = 10.0
HOST_RATIO_TO_ADD = 1.5

_BW_SOURCES = {
    "merge_attn_states": "issue 3",
    "correct_attn_out": "issue 5",
    "a2a_pack": "issue 5",
    "a2a_unpack_combine": "issue 5",
}
_ALL_KERNELS = (*_BW_SOURCES, "mask_dcp_empty_shards_")


def _decode_target(kernel: str, **rule: Any) -> Target:
    """A decode-size target (B in {1, 8, 64}) of ``kernel`` over the page's decode rows."""
    is_mask = kernel == "mask_dcp_empty_shards_"
    return Target(
        table="kernels",
        kernel=kernel,
        dtypes=("float32",) if is_mask else ("bfloat16",),
        shapes=MASK_SHAPES if is_mask else HEAD_SHAPES,
        ns=(0,) if is_mask else ALL_N,
        bs=DECODE_B,
        **rule,
    )


# The host rule: <= 10 µs per eager call, or <= 1.5x an eager add_ of the same rounds.
_HOST_RULE: dict[str, Any] = dict(
    metric="host_us",
    op="<=",
    threshold=HOST_US,
    alt_metric="ratio_to_add",
    alt_op="<=",
    alt_threshold=HOST_RATIO_TO_ADD,
    unit="us",
)


def _host_target(kernel: str, **rule: Any) -> Target:
    """A host-overhead target of ``kernel`` over the page's host rows (any dtype)."""
    return Target(table="host", kernel=kernel, dtypes=(), **rule)


def targets() -> list[Target]:
    """Every target, in page order."""
    out: list[Target] = []
    for kernel, source in _BW_SOURCES.items():
        out.append(
            Target(
                name=f"bw/{kernel}",
                source=source,
                description=f"`{kernel}` B=4096 bandwidth ≥ 85% of copy",
                table="kernels",
                kernel=kernel,
                metric="copy_ratio",
                op=">=",
                threshold=COPY_FRACTION,
                shapes=HEAD_SHAPES,
                ns=ALL_N,
                bs=(4096,),
                unit="percent",
            )
        )
    # The literal rule cannot hold where the payload itself takes longer than an empty kernel
    # at full bandwidth (B=64 of an MLA layer: tens of MB); the second reading judges each
    # decode size against the larger of the two floors.
    decode_readings = (
        ("decode", "issue 5", "empty_graph_ratio", "1.5× empty kernel"),
        (
            "decode-floor",
            "issue 5 (bandwidth-aware reading)",
            "floor_ratio",
            "1.5× max(empty kernel, bytes at copy BW)",
        ),
    )
    for prefix, source, metric, rule in decode_readings:
        for kernel in _ALL_KERNELS:
            out.append(
                _decode_target(
                    kernel,
                    name=f"{prefix}/{kernel}",
                    source=source,
                    description=f"`{kernel}` B∈{{1,8,64}} graph replay ≤ {rule}",
                    metric=metric,
                    op="<=",
                    threshold=DECODE_RATIO,
                    unit="x",
                )
            )
    # The measured floor: a device copy of the row's bytes, replayed like the row (launch,
    # DRAM latency and ramp included). size_copy_ratio = copy time / our time there.
    for kernel in _ALL_KERNELS:
        out.append(
            _decode_target(
                kernel,
                name=f"decode-copy/{kernel}",
                source="issue 5 (same-size copy reading)",
                description=f"`{kernel}` B∈{{1,8,64}} graph replay ≤ 1.5× a same-size copy's",
                metric="size_copy_ratio",
                op=">=",
                threshold=1.0 / DECODE_RATIO,
                unit="percent",
            )
        )
    out.append(
        _host_target(
            "launch_cached",
            name="host/launch_cached",
            source="issue 3",
            description="`launch_cached` host time per launch ≤ 10 µs (or ≤ 1.5× `add_`)",
            **_HOST_RULE,
        )
    )
    # The default path of a GPU process: launch plans on (repeated calls of one argument
    # layout replay from native code). The merge is held to issue 5's rule beyond issue 3.
    for kernel in _ALL_KERNELS:
        source = "op level (beyond issue 3)" if kernel == "merge_attn_states" else "issue 5"
        out.append(
            _host_target(
                f"{kernel} [plans]",
                name=f"host-plans/{kernel}",
                source=source,
                description=f"`{kernel}` eager host overhead (the default path: launch plans "
                "on) ≤ 10 µs (or ≤ 1.5× `add_`)",
                **_HOST_RULE,
            )
        )
    # The same calls on the Python path (CPATTN_LAUNCH_PLANS=0), by the same rule.
    for kernel in _ALL_KERNELS:
        source = "op level" if kernel == "merge_attn_states" else "issue 5"
        out.append(
            _host_target(
                kernel,
                name=f"host/{kernel}",
                source=f"{source}, Python-path reading",
                description=f"`{kernel}` eager host overhead, launch plans off, ≤ 10 µs "
                "(or ≤ 1.5× `add_`)",
                **_HOST_RULE,
            )
        )
    # Second reading of the default path: against a torch op that allocates its output
    # (out-of-place add), for the ops that allocate theirs (the mask works in place: add_ is
    # its like).
    for kernel in _BW_SOURCES:
        out.append(
            _host_target(
                f"{kernel} [plans]",
                name=f"host-alloc/{kernel}",
                source="issue 5, allocating-op reading",
                description=f"`{kernel}` eager host overhead, launch plans on, ≤ 1.5× "
                "out-of-place `torch.add`",
                metric="ratio_to_add_out",
                op="<=",
                threshold=HOST_RATIO_TO_ADD,
                unit="x",
            )
        )
    return out
