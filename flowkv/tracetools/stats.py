"""What a trace summary holds, and the span names and span readers that summarizing and the timeline share."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from flowkv.otlp_json import SpanRecord

# An engine's runs; a promotion's decode (inside the get that promoted, or a prefetch's own); a node
# server's writer run.
RUN_ROOT_NAMES = frozenset({"flowkv.store", "flowkv.retrieve", "flowkv.lookup", "flowkv.promote", "flowkv.server"})
WAIT_SPAN = "flowkv.wait"
STEP_SPAN = "flowkv.step"
# CacheBlend in the vLLM worker: every step of a blend is a span named flowkv.blend.<step>;
# the write span closes each blend and carries its token counts.
BLEND_SPAN_PREFIX = "flowkv.blend."
BLEND_WRITE_SPAN = "flowkv.blend.write"

COPY_GBPS_ATTRIBUTE = "flowkv.host.copy_gbps"
_PROBE_ATTRIBUTES = ("flowkv.faults", "flowkv.cpu_ns", "flowkv.preempted")


@attrs.frozen
class StageStats:
    """Totals of one stage (by run kind and stage name) over every run."""

    kind: str  # store / retrieve / lookup / promote / server ("" when unknown)
    stage: str
    count: int  # stage spans, i.e. runs (layer runs count one each)
    own_ns: int  # time in the stage's own code, upstream excluded
    own_time_measured: bool  # False: some spans lacked flowkv.own_time_ns, see summarize()
    total_bytes: int
    items_out: int
    errors: int
    share: float  # own_ns / own time of all stages of this kind
    tiers: tuple[str, ...] = ()  # flowkv.tier values the stage reported
    gbps: float | None = None  # total_bytes / own time, GB/s; None without bytes or time
    transfer: bool = False  # moves KV between the engine's cache and chunk buffers (role transfer, or probed)
    faults: int | None = None  # page faults during its transfers (None: not recorded)
    cpu_ns: int | None = None  # CPU time of the transferring thread
    preempted: int | None = None  # involuntary context switches meanwhile
    row_bytes: int | None = None  # the shortest row one copy moved
    role: str = ""  # the stage's declared role (flowkv.stage.role; a built-in's own for older traces)


@attrs.frozen
class LayerStats:
    """Transfer and compute of one layer, summed over every step."""

    layer: int
    transfer_ns: int  # union of the layer's transfer spans, per process
    blocked_ns: int  # the part of transfer_ns that coincides with flowkv.wait spans
    wait_ns: int  # flowkv.wait time for this layer
    compute_ns: int | None  # inference-thread time between the previous wait and this layer's; None if unknown
    transfer_bytes: int


@attrs.frozen
class TierStats:
    """A storage tier as seen from stages that name it (``flowkv.tier``)."""

    tier: str
    own_ns: int
    count: int
    hit_tokens: int | None  # None when no span reported hit_tokens


@attrs.frozen
class BlendStats:
    """CacheBlend loads (``flowkv.blend.*`` spans): what share of the reused tokens was recomputed, at what cost."""

    blends: int  # loads blended (one write span each)
    reused_tokens: int  # tokens the blends loaded from stored segments
    recomputed_tokens: int  # of them, tokens recomputed past the check layer
    recompute_share: float | None  # recomputed / reused (None without reused tokens)
    step_ns: dict[str, int]  # blend step (rerotate, recompute, attend, ...) -> summed duration
    load_ns: int  # every step of the loads' blends (saves' "stage" copies not included)


@attrs.frozen
class Summary:
    """What ``summarize`` finds in a trace; ``attrs.asdict`` gives its JSON."""

    span_count: int
    trace_count: int
    runs: dict[str, int]  # run kind -> number of run roots
    run_ns: dict[str, int]  # run kind -> summed root durations
    step_ns: int  # summed flowkv.step durations
    stages: tuple[StageStats, ...]  # by own time, largest first
    slowest: tuple[str, ...]  # "kind/stage" of the top stages by own time
    layers: tuple[LayerStats, ...]
    tiers: tuple[TierStats, ...]
    transfer_ns: int
    blocked_ns: int
    overlap_ratio: float | None  # None without layer spans or without flowkv.wait spans
    suggestions: tuple[str, ...]
    copy_gbps: float | None = None  # the machine's copy bandwidth transfer stages are held against
    copy_gbps_source: str = ""  # "trace" (resource attribute), "given", "measured by summarize", ""
    blend: BlendStats | None = None  # None: no blend spans in the trace


# --------------------------------------------------------------------------
# interval arithmetic over [start, end) in nanoseconds
# --------------------------------------------------------------------------


def blend_stats(spans: Sequence[SpanRecord]) -> BlendStats | None:
    """The ``BlendStats`` of a trace's ``flowkv.blend.*`` spans, None when it has none."""
    blend = [span for span in spans if span.name.startswith(BLEND_SPAN_PREFIX)]
    if not blend:
        return None
    step_ns: dict[str, int] = {}
    for span in blend:
        step = span.name[len(BLEND_SPAN_PREFIX):]
        step_ns[step] = step_ns.get(step, 0) + span.end_ns - span.start_ns
    # One write per blend carries its counts (the others write one layer each, "flowkv.layer").
    writes = [span for span in blend if span.name == BLEND_WRITE_SPAN and "flowkv.layer" not in span.attributes]
    reused = sum(_int_attr(span, "flowkv.blend.reused_tokens") for span in writes)
    recomputed = sum(_int_attr(span, "flowkv.blend.recomputed_tokens") for span in writes)
    return BlendStats(blends=len(writes), reused_tokens=reused, recomputed_tokens=recomputed,
                      recompute_share=recomputed / reused if reused else None,
                      step_ns=dict(sorted(step_ns.items())),
                      load_ns=sum(ns for step, ns in step_ns.items() if step != "stage"))


def _union(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def _length(merged: Sequence[tuple[int, int]]) -> int:
    return sum(end - start for start, end in merged)


def _intersection_length(a: Sequence[tuple[int, int]], b: Sequence[tuple[int, int]]) -> int:
    """Length of the intersection of two merged (sorted, disjoint) interval lists."""
    total, i, j = 0, 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            total += end - start
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


# --------------------------------------------------------------------------
# classifying spans
# --------------------------------------------------------------------------


def _process_key(span: SpanRecord) -> tuple:
    # Spans of one process share a resource (service.instance.id differs per provider).
    return tuple(sorted((k, str(v)) for k, v in span.resource.items()))


def _is_run_root(span: SpanRecord) -> bool:
    return span.name in RUN_ROOT_NAMES


def _layer(span: SpanRecord) -> int | None:
    layer = span.attributes.get("flowkv.layer")
    return layer if isinstance(layer, int) and not isinstance(layer, bool) else None


def _int_attr(span: SpanRecord, key: str) -> int:
    value = span.attributes.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _stage_spans(spans: Sequence[SpanRecord], by_id: dict[str, SpanRecord]) -> list[SpanRecord]:
    stages = []
    for span in spans:
        if "flowkv.stage" in span.attributes:
            stages.append(span)
        elif span.parent_span_id in by_id and _is_run_root(by_id[span.parent_span_id]):
            stages.append(span)  # a stage span from a runner that did not tag flowkv.stage
    return stages


def _stage_kind(span: SpanRecord, by_id: dict[str, SpanRecord]) -> str:
    kind = span.attributes.get("flowkv.kind")
    if isinstance(kind, str):
        return kind
    parent = by_id.get(span.parent_span_id or "")
    if parent is not None and _is_run_root(parent):
        return parent.name.removeprefix("flowkv.")
    return ""
