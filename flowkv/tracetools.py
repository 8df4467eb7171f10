"""``flowkv trace summarize|timeline``: read flowkv's traces and say where time goes.

Input is any list of ``SpanRecord`` (``flowkv.otlp_json.load_spans`` reads
the OTLP/JSON files that ``[telemetry] exporter = "file"`` writes, or OTLP
JSON exported from Jaeger). The span names and attributes read here are the
ones ``docs/internals.md`` fixes:

* a run root ``flowkv.store`` / ``flowkv.retrieve`` / ``flowkv.lookup``;
* one child per stage, carrying ``flowkv.stage``, ``flowkv.kind``,
  ``flowkv.own_time_ns``, ``flowkv.bytes``, ``flowkv.items_out``,
  ``flowkv.tier``, ``flowkv.hit_tokens``, and ``flowkv.layer`` when layerwise;
* from the vLLM connector: ``flowkv.wait`` (``flowkv.layer``) for each
  interval the inference thread is blocked on a layer's transfer, and
  ``flowkv.step`` per engine step;
* on transfer stages (gather, scatter), what their ``flowkv.kernels.TransferProbe``
  counted: ``flowkv.faults``, ``flowkv.cpu_ns``, ``flowkv.preempted``,
  ``flowkv.row_bytes``; and on the resource, ``flowkv.host.copy_gbps``, the
  machine's copy bandwidth the process measured when it started tracing.

Example::

    flowkv trace summarize traces/flowkv-20250101-120000-4242.json
    flowkv trace timeline traces/flowkv-20250101-120000-4242.json -o timeline.html
"""

from __future__ import annotations

import argparse
import html
import json
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs

from flowkv.otlp_json import SpanRecord, TraceFileError, load_spans

__all__ = [
    "LayerStats",
    "StageStats",
    "Summary",
    "TierStats",
    "add_commands",
    "format_summary",
    "main",
    "summarize",
    "timeline",
    "trace_copy_gbps",
]

RUN_ROOT_NAMES = frozenset({"flowkv.store", "flowkv.retrieve", "flowkv.lookup"})
WAIT_SPAN = "flowkv.wait"
STEP_SPAN = "flowkv.step"

# Thresholds of the suggestion rules (see ``suggest``).
LOW_OVERLAP = 0.5
VERY_LOW_OVERLAP = 0.2
GOOD_OVERLAP = 0.9
DOMINANT_SHARE = 0.3  # a stage taking this share of its run kind's own time
SMALL_ITEM_BYTES = 1 << 20  # batching pays when items are smaller than this
SMALL_CHUNK_BYTES = 256 << 10  # a tier call moving less than this is call-bound
MISSING_TIER_SHARE = 0.2
STEP_SHARE_FOR_LAYERWISE = 0.2
MIN_ITEMS_FOR_BATCHING = 16
FAR_BELOW_COPY = 0.5  # a transfer stage slower than this share of the machine's copy bandwidth
FAULTED_SHARE = 0.25  # of a transfer's bytes landing on pages it faulted in: first-touch faults
CONTENDED_CPU_SHARE = 0.75  # the transferring thread on a core less than this share of the time
SHORT_ROW_BYTES = 4096  # rows shorter than this make a gather/scatter slower than a copy
SHORT_CALL_NS = 250_000  # a transfer call this short at copy speed pays mostly its fixed cost
COPY_GBPS_ATTRIBUTE = "flowkv.host.copy_gbps"
_PROBE_ATTRIBUTES = ("flowkv.faults", "flowkv.cpu_ns", "flowkv.preempted")
_TRANSFER_STAGES = frozenset({"gather", "scatter"})
_PAGE_BYTES = 4096


@attrs.frozen
class StageStats:
    """Totals of one stage (by run kind and stage name) over every run."""

    kind: str  # store / retrieve / lookup ("" when unknown)
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
    transfer: bool = False  # moves KV between the engine's cache and chunk buffers (gather, scatter)
    faults: int | None = None  # page faults during its transfers (None: not recorded)
    cpu_ns: int | None = None  # CPU time of the transferring thread
    preempted: int | None = None  # involuntary context switches meanwhile
    row_bytes: int | None = None  # the shortest row one copy moved


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


# --------------------------------------------------------------------------
# interval arithmetic over [start, end) in nanoseconds
# --------------------------------------------------------------------------


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


# --------------------------------------------------------------------------
# summarize
# --------------------------------------------------------------------------


def trace_copy_gbps(spans: Sequence[SpanRecord]) -> float | None:
    """The copy bandwidth the traced processes recorded (``flowkv.host.copy_gbps`` on their
    resource); the median when several did, None when none did."""
    values = sorted({float(span.resource[COPY_GBPS_ATTRIBUTE]) for span in spans
                     if isinstance(span.resource.get(COPY_GBPS_ATTRIBUTE), (int, float))})
    return values[len(values) // 2] if values else None


def summarize(spans: Sequence[SpanRecord], *, copy_gbps: float | None = None,
              copy_gbps_source: str = "given") -> Summary:
    """Where time goes in a flowkv trace.

    **Own time per stage.** ``flowkv.own_time_ns`` when the span has it (the
    runner measures the stage's own code, upstream stages excluded). A stage
    span without it counts its duration minus the time covered by its own
    child spans; that is an upper bound, because in a pull chain upstream
    stages run inside a downstream stage's ``next()`` without being its
    children — ``StageStats.own_time_measured`` is False then and the table
    marks the row with ``*``.

    **Transfer time of a layer.** In layerwise runs every run root and stage
    span carries ``flowkv.layer``. A layer's transfer time is the length of
    the union of the intervals of its spans (so a root and its stages, or
    concurrent stages, are not counted twice), computed per process and
    summed over processes and steps.

    **Blocked time, overlap ratio.** ``flowkv.wait`` spans are the intervals
    in which the inference thread is blocked on a transfer. Blocked time is
    the part of the transfer time that coincides with any wait interval of
    the same process (the inference thread is stalled then, whichever layer
    it waits for). The **overlap ratio** is

        (transfer_ns - blocked_ns) / transfer_ns

    over all layers: the fraction of transfer time hidden behind compute.
    1.0 means no transfer ever stalled inference; 0.0 means the inference
    thread waited through every transfer. It is None without layer spans,
    and without any ``flowkv.wait`` span (then nothing says whether the
    inference thread was blocked).

    **Compute between layers.** For each ``flowkv.wait`` of layer L, the
    time from the end of the previous wait (same ``flowkv.step`` parent, or
    same process when waits have no parent) to its start: the compute the
    inference thread did before it needed layer L. The first wait of a step
    has no predecessor and adds nothing; a layer with no such interval has
    ``compute_ns`` None.

    **Bytes per second.** A stage that reports bytes gets ``gbps``, its bytes
    over its own time. Transfer stages (gather, scatter, or any stage whose
    spans carry a ``TransferProbe``'s attributes) are held against the
    machine's copy bandwidth: ``copy_gbps`` when given, else the one the
    trace's resources recorded (``copy_gbps_source`` says which).

    ``suggestions`` come from ``suggest`` (rules documented there).
    """
    if copy_gbps is None:
        copy_gbps = trace_copy_gbps(spans)
        copy_gbps_source = "trace" if copy_gbps is not None else ""
    by_id = {span.span_id: span for span in spans}

    runs: dict[str, int] = defaultdict(int)
    run_ns: dict[str, int] = defaultdict(int)
    for span in spans:
        if _is_run_root(span):
            kind = span.name.removeprefix("flowkv.")
            runs[kind] += 1
            run_ns[kind] += span.duration_ns
    step_ns = sum(span.duration_ns for span in spans if span.name == STEP_SPAN)

    children: dict[str, list[SpanRecord]] = defaultdict(list)
    for span in spans:
        if span.parent_span_id:
            children[span.parent_span_id].append(span)

    # -- stages ------------------------------------------------------------
    totals: dict[tuple[str, str], dict[str, Any]] = {}
    tier_totals: dict[str, dict[str, Any]] = {}
    for span in _stage_spans(spans, by_id):
        kind = _stage_kind(span, by_id)
        name = span.attributes.get("flowkv.stage")
        name = name if isinstance(name, str) else span.name
        entry = totals.setdefault(
            (kind, name), {"count": 0, "own": 0, "measured": True, "bytes": 0, "items": 0, "errors": 0, "tiers": set(),
                           "probe": None, "rows": None}
        )
        own = span.attributes.get("flowkv.own_time_ns")
        if isinstance(own, int) and not isinstance(own, bool):
            own_ns = own
        else:
            clipped = ((max(c.start_ns, span.start_ns), min(c.end_ns, span.end_ns)) for c in children[span.span_id])
            own_ns = span.duration_ns - _length(_union(clipped))
            entry["measured"] = False
        entry["count"] += 1
        entry["own"] += own_ns
        entry["bytes"] += _int_attr(span, "flowkv.bytes")
        entry["items"] += _int_attr(span, "flowkv.items_out")
        entry["errors"] += int("flowkv.error" in span.attributes or span.status_code == "error")
        if any(key in span.attributes for key in _PROBE_ATTRIBUTES):
            probe = entry["probe"] or [0, 0, 0]
            entry["probe"] = [total + _int_attr(span, key) for total, key in zip(probe, _PROBE_ATTRIBUTES)]
        rows = _int_attr(span, "flowkv.row_bytes")
        if rows and (entry["rows"] is None or rows < entry["rows"]):
            entry["rows"] = rows

        tier = span.attributes.get("flowkv.tier")
        if isinstance(tier, str):
            entry["tiers"].add(tier)
        if isinstance(tier, str) and kind in ("lookup", "retrieve"):
            tier_entry = tier_totals.setdefault(tier, {"own": 0, "count": 0, "hits": None})
            tier_entry["own"] += own_ns
            tier_entry["count"] += 1
            if "flowkv.hit_tokens" in span.attributes:
                tier_entry["hits"] = (tier_entry["hits"] or 0) + _int_attr(span, "flowkv.hit_tokens")

    kind_own: dict[str, int] = defaultdict(int)
    for (kind, _), entry in totals.items():
        kind_own[kind] += entry["own"]
    stages = tuple(
        sorted(
            (
                StageStats(
                    kind=kind,
                    stage=name,
                    count=e["count"],
                    own_ns=e["own"],
                    own_time_measured=e["measured"],
                    total_bytes=e["bytes"],
                    items_out=e["items"],
                    errors=e["errors"],
                    share=e["own"] / kind_own[kind] if kind_own[kind] else 0.0,
                    tiers=tuple(sorted(e["tiers"])),
                    gbps=e["bytes"] / e["own"] if e["bytes"] and e["own"] > 0 else None,
                    transfer=name in _TRANSFER_STAGES or e["probe"] is not None,
                    faults=None if e["probe"] is None else e["probe"][0],
                    cpu_ns=None if e["probe"] is None else e["probe"][1],
                    preempted=None if e["probe"] is None else e["probe"][2],
                    row_bytes=e["rows"],
                )
                for (kind, name), e in totals.items()
            ),
            key=lambda s: (-s.own_ns, s.kind, s.stage),
        )
    )
    tiers = tuple(
        TierStats(tier=t, own_ns=e["own"], count=e["count"], hit_tokens=e["hits"])
        for t, e in sorted(tier_totals.items(), key=lambda item: -item[1]["own"])
    )

    # -- layers and overlap ----------------------------------------------
    waits = [span for span in spans if span.name == WAIT_SPAN]
    wait_union_by_process = defaultdict(list)
    for span in waits:
        wait_union_by_process[_process_key(span)].append((span.start_ns, span.end_ns))
    wait_union_by_process = {p: _union(iv) for p, iv in wait_union_by_process.items()}

    transfer_intervals: dict[tuple[int, tuple], list[tuple[int, int]]] = defaultdict(list)
    transfer_bytes: dict[int, int] = defaultdict(int)
    for span in spans:
        layer = _layer(span)
        if layer is None or span.name in (WAIT_SPAN, STEP_SPAN):
            continue
        transfer_intervals[(layer, _process_key(span))].append((span.start_ns, span.end_ns))
        if not _is_run_root(span):
            transfer_bytes[layer] += _int_attr(span, "flowkv.bytes")

    layer_transfer: dict[int, int] = defaultdict(int)
    layer_blocked: dict[int, int] = defaultdict(int)
    for (layer, process), intervals in transfer_intervals.items():
        merged = _union(intervals)
        layer_transfer[layer] += _length(merged)
        layer_blocked[layer] += _intersection_length(merged, wait_union_by_process.get(process, []))

    layer_wait: dict[int, int] = defaultdict(int)
    layer_compute: dict[int, int] = {}
    wait_groups: dict[Any, list[SpanRecord]] = defaultdict(list)
    for span in waits:
        layer = _layer(span)
        if layer is not None:
            layer_wait[layer] += span.duration_ns
        group = ("step", span.parent_span_id) if span.parent_span_id else ("process", _process_key(span))
        wait_groups[group].append(span)
    for group in wait_groups.values():
        group.sort(key=lambda s: s.start_ns)
        for previous, current in zip(group, group[1:]):
            layer = _layer(current)
            if layer is not None:
                layer_compute[layer] = layer_compute.get(layer, 0) + max(0, current.start_ns - previous.end_ns)

    layer_ids = sorted(set(layer_transfer) | set(layer_wait))
    layers = tuple(
        LayerStats(
            layer=layer,
            transfer_ns=layer_transfer.get(layer, 0),
            blocked_ns=layer_blocked.get(layer, 0),
            wait_ns=layer_wait.get(layer, 0),
            compute_ns=layer_compute.get(layer),
            transfer_bytes=transfer_bytes.get(layer, 0),
        )
        for layer in layer_ids
    )
    transfer_ns = sum(layer_transfer.values())
    blocked_ns = sum(layer_blocked.values())
    # Without any wait span the trace cannot tell hidden from blocked (e.g. runs
    # traced outside the vLLM connector), so no ratio rather than a false 1.0.
    overlap_ratio = (transfer_ns - blocked_ns) / transfer_ns if transfer_ns and waits else None

    summary = Summary(
        span_count=len(spans),
        trace_count=len({span.trace_id for span in spans}),
        runs=dict(sorted(runs.items())),
        run_ns=dict(sorted(run_ns.items())),
        step_ns=step_ns,
        stages=stages,
        slowest=tuple(f"{s.kind}/{s.stage}" if s.kind else s.stage for s in stages[:3]),
        layers=layers,
        tiers=tiers,
        transfer_ns=transfer_ns,
        blocked_ns=blocked_ns,
        overlap_ratio=overlap_ratio,
        suggestions=(),
        copy_gbps=copy_gbps,
        copy_gbps_source=copy_gbps_source if copy_gbps is not None else "",
    )
    return attrs.evolve(summary, suggestions=tuple(suggest(summary)))


_CODEC_WORDS = ("compress", "codec", "encode", "decode", "quant")


def suggest(summary: Summary) -> list[str]:
    """Plain-language advice on which pipeline setting to change, by rule.

    Each rule fires independently; none firing says so. Thresholds are the
    module constants named in brackets.

    1. **Layerwise, transfers longer than compute.** Overlap ratio below
       [LOW_OVERLAP] and the mean transfer per layer longer than the mean
       compute between layers: overlap cannot exceed compute/transfer, so
       move fewer bytes (a codec) or serve from a faster tier first.
    2. **Layerwise gains little.** Overlap ratio below [VERY_LOW_OVERLAP]:
       per-layer runs pay per-layer overhead for almost no hiding; try
       ``layerwise = false``.
    3. **Layerwise works.** Overlap ratio at least [GOOD_OVERLAP]: leave it.
    4. **Layerwise off, loads matter.** No layer spans, but retrieve runs
       take at least [STEP_SHARE_FOR_LAYERWISE] of the ``flowkv.step`` time:
       try ``layerwise = true`` so loads overlap compute.
    5. **Codec dominates.** A stage whose name says codec (compress, codec,
       encode, decode, quant) takes at least [DOMINANT_SHARE] of its run
       kind's own time: pick a faster codec, or none.
    6. **Small items, batching.** A stage with at least [DOMINANT_SHARE] of
       its kind's own time, at least [MIN_ITEMS_FOR_BATCHING] items, and
       under [SMALL_ITEM_BYTES] per item on average: raise its ``batch``.
    7. **Small chunks at a tier.** A stage naming a ``flowkv.tier`` with at
       least [DOMINANT_SHARE] of its kind's own time that moves under
       [SMALL_CHUNK_BYTES] per item: raise ``chunk_size`` (fewer, larger
       tier calls; prefix hits become coarser).
    8. **A tier that never hits.** A tier that reported ``hit_tokens`` = 0
       over all its lookup/retrieve spans yet took at least
       [MISSING_TIER_SHARE] of lookup+retrieve stage time, while another
       tier hit: move it later in the tier order, or drop it.
    9. **A transfer far below the copy bandwidth.** A transfer stage whose
       bytes per second are under [FAR_BELOW_COPY] of the machine's copy
       bandwidth, with the likely cause the probe tells apart, each that
       applies: *first-touch page faults* (page faults for at least
       [FAULTED_SHARE] of its bytes, in 4 KiB pages); *thread contention*
       (the transferring thread on a core for under [CONTENDED_CPU_SHARE] of
       the stage's time); *layout* (copies of rows under [SHORT_ROW_BYTES]);
       *per-call cost* (chunks that take under [SHORT_CALL_NS] each at copy
       speed).
    """
    advice: list[str] = []
    ratio = summary.overlap_ratio
    if ratio is not None:
        computes = [layer.compute_ns for layer in summary.layers if layer.compute_ns is not None]
        with_transfer = [layer for layer in summary.layers if layer.transfer_ns]
        mean_transfer = sum(l.transfer_ns for l in with_transfer) / len(with_transfer) if with_transfer else 0
        mean_compute = sum(computes) / len(computes) if computes else None
        if ratio < LOW_OVERLAP and mean_compute is not None and mean_transfer > mean_compute:
            advice.append(
                f"Layer transfers ({_ms(mean_transfer)} per layer) outlast the compute between layers "
                f"({_ms(mean_compute)}), so only {ratio:.0%} of transfer time is hidden: move fewer bytes "
                "per layer (add or change the codec) or put the tier that serves the hits first in the tier order."
            )
        if ratio < VERY_LOW_OVERLAP:
            advice.append(
                f"Layerwise hides only {ratio:.0%} of transfer time: try `layerwise = false`; "
                "one bulk transfer avoids the per-layer overhead."
            )
        if ratio >= GOOD_OVERLAP:
            advice.append(f"Layerwise hides {ratio:.0%} of transfer time: keep `layerwise = true`.")
    elif summary.runs.get("retrieve") and summary.step_ns:
        share = summary.run_ns.get("retrieve", 0) / summary.step_ns
        if share >= STEP_SHARE_FOR_LAYERWISE:
            advice.append(
                f"Retrieve runs take {share:.0%} of engine step time with layerwise off: "
                "try `layerwise = true` so loads overlap the model's compute."
            )

    for stage in summary.stages:
        label = f"{stage.kind}/{stage.stage}" if stage.kind else stage.stage
        if stage.share < DOMINANT_SHARE:
            continue
        if any(word in stage.stage.lower() for word in _CODEC_WORDS):
            advice.append(
                f"Codec stage {label} takes {stage.share:.0%} of {stage.kind or 'its'} time: "
                "choose a faster codec (or none) for this pipeline."
            )
            continue
        per_item = stage.total_bytes / stage.items_out if stage.items_out and stage.total_bytes else None
        if per_item is None:
            continue
        if stage.items_out >= MIN_ITEMS_FOR_BATCHING and per_item < SMALL_ITEM_BYTES:
            advice.append(
                f"Stage {label} takes {stage.share:.0%} of {stage.kind or 'its'} time on small items "
                f"({_bytes(per_item)} each): raise its `batch` setting if it has one."
            )
    for stage in summary.stages:
        label = f"{stage.kind}/{stage.stage}" if stage.kind else stage.stage
        if not stage.tiers or stage.share < DOMINANT_SHARE:
            continue
        if stage.items_out and stage.total_bytes and stage.total_bytes / stage.items_out < SMALL_CHUNK_BYTES:
            advice.append(
                f"Tier stage {label} moves only {_bytes(stage.total_bytes / stage.items_out)} per chunk and takes "
                f"{stage.share:.0%} of {stage.kind} time: raise `chunk_size` so each tier call carries more."
            )

    if summary.copy_gbps:
        for stage in summary.stages:
            if stage.transfer and stage.gbps is not None and stage.gbps < FAR_BELOW_COPY * summary.copy_gbps:
                advice.append(_slow_transfer(stage, summary.copy_gbps))

    tier_time = sum(t.own_ns for t in summary.tiers)
    if tier_time and any(t.hit_tokens for t in summary.tiers):
        for tier in summary.tiers:
            if tier.hit_tokens == 0 and tier.own_ns / tier_time >= MISSING_TIER_SHARE:
                hitting = ", ".join(t.tier for t in summary.tiers if t.hit_tokens)
                advice.append(
                    f"Tier {tier.tier} found no hits yet took {tier.own_ns / tier_time:.0%} of lookup/retrieve "
                    f"tier time: move it after {hitting} in the tier order, or drop it."
                )
    if not advice:
        advice.append("No setting stands out from these numbers.")
    return advice


def _slow_transfer(stage: StageStats, copy_gbps: float) -> str:
    """Rule 9's advice for one transfer stage: how far below the copy bandwidth, and why."""
    label = f"{stage.kind}/{stage.stage}" if stage.kind else stage.stage
    causes = []
    if stage.faults is not None and stage.faults * _PAGE_BYTES >= FAULTED_SHARE * stage.total_bytes:
        causes.append(
            f"first-touch page faults ({stage.faults} faults for {_bytes(stage.total_bytes)}, "
            f"{stage.faults * _PAGE_BYTES / stage.total_bytes:.0%} of its bytes in 4 KiB pages): the chunk memory "
            "was never written before; keep `[tiers.memory] prefault` on (the default: a window ahead of the "
            "stores, refilled while the engine idles) and raise `prefault_window` if stores outrun it"
        )
    if stage.cpu_ns is not None and stage.own_ns and stage.cpu_ns < CONTENDED_CPU_SHARE * stage.own_ns:
        causes.append(
            f"thread contention (the transferring thread was on a core {stage.cpu_ns / stage.own_ns:.0%} of the "
            f"time, {stage.preempted or 0} preemptions): other threads held the cores, e.g. the inference "
            "engine's OpenMP workers or other processes; give flowkv's copies a core of their own"
        )
    if stage.row_bytes is not None and stage.row_bytes < SHORT_ROW_BYTES:
        causes.append(
            f"layout (its copies move rows of {_bytes(stage.row_bytes)}): rows are whole blocks only when a "
            "chunk is whole blocks of the cache, so make `chunk_size` a multiple of the block size (a partial "
            "last chunk moves token by token), and keep chunk buffers in the engine's format (chunk format 2)"
        )
    per_item = stage.total_bytes / stage.items_out if stage.items_out else 0
    if per_item and per_item / copy_gbps < SHORT_CALL_NS:
        causes.append(
            f"per-call cost (each chunk moves {_bytes(per_item)}, {per_item / copy_gbps / 1e3:.0f} us at copy "
            "speed, so the fixed cost of a transfer call, tens of us, weighs): a larger `chunk_size` moves "
            "more per call"
        )
    if not causes:
        causes.append("none that the trace records (no page faults, contention, short rows or small chunks)")
    return (
        f"Transfer stage {label} moves {stage.gbps:.1f} GB/s, {stage.gbps / copy_gbps:.0%} of this machine's "
        f"copy bandwidth ({copy_gbps:.1f} GB/s). Likely cause: " + "; ".join(causes) + "."
    )


# --------------------------------------------------------------------------
# formatting
# --------------------------------------------------------------------------


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.3f} ms"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_summary(summary: Summary) -> str:
    """The summary as plain text for a terminal."""
    lines = [
        f"{summary.span_count} spans in {summary.trace_count} trace{'s' if summary.trace_count != 1 else ''}; runs: "
        + (", ".join(f"{k} {n} ({_ms(summary.run_ns[k])})" for k, n in summary.runs.items()) or "none"),
    ]
    if summary.step_ns:
        lines.append(f"engine steps: {_ms(summary.step_ns)}")
    lines.append("")
    if summary.stages:
        lines.append(f"{'stage':<28} {'runs':>6} {'own time':>14} {'share':>6} {'bytes':>11} {'items':>7} "
                     f"{'GB/s':>7} {'x copy':>7}")
        for s in summary.stages:
            label = (f"{s.kind}/{s.stage}" if s.kind else s.stage) + ("" if s.own_time_measured else " *")
            versus = f"{s.gbps / summary.copy_gbps:.2f}" if s.transfer and s.gbps and summary.copy_gbps else "-"
            lines.append(
                f"{label:<28} {s.count:>6} {_ms(s.own_ns):>14} {s.share:>6.0%} "
                f"{_bytes(s.total_bytes) if s.total_bytes else '-':>11} {s.items_out:>7} "
                f"{f'{s.gbps:.2f}' if s.gbps is not None else '-':>7} {versus:>7}"
            )
        if not all(s.own_time_measured for s in summary.stages):
            lines.append("  * no flowkv.own_time_ns: duration minus child spans (an upper bound)")
        if summary.copy_gbps:
            where = {"trace": "recorded in the trace", "given": "given",
                     "measured by summarize": "measured now by summarize on this machine"}
            lines.append(f"x copy: a transfer stage's GB/s over this machine's copy bandwidth, "
                         f"{summary.copy_gbps:.1f} GB/s ({where.get(summary.copy_gbps_source, summary.copy_gbps_source)})")
        lines.append("slowest: " + ", ".join(summary.slowest))
    else:
        lines.append("no stage spans found")
    if summary.tiers:
        lines.append("")
        lines.append(f"{'tier':<16} {'spans':>6} {'own time':>14} {'hit tokens':>11}")
        for t in summary.tiers:
            hits = "-" if t.hit_tokens is None else str(t.hit_tokens)
            lines.append(f"{t.tier:<16} {t.count:>6} {_ms(t.own_ns):>14} {hits:>11}")
    if summary.layers:
        lines.append("")
        lines.append(f"{'layer':>5} {'transfer':>14} {'blocked':>14} {'compute before':>15} {'bytes':>11}")
        for l in summary.layers:
            compute = "-" if l.compute_ns is None else _ms(l.compute_ns)
            lines.append(
                f"{l.layer:>5} {_ms(l.transfer_ns):>14} {_ms(l.blocked_ns):>14} {compute:>15} "
                f"{_bytes(l.transfer_bytes) if l.transfer_bytes else '-':>11}"
            )
        if summary.overlap_ratio is None:
            lines.append("overlap ratio: n/a (no flowkv.wait spans: the trace does not say when inference was blocked)")
        else:
            lines.append(
                f"overlap ratio: {summary.overlap_ratio:.3f} ({_ms(summary.transfer_ns - summary.blocked_ns)} "
                f"of {_ms(summary.transfer_ns)} transfer hidden behind compute)"
            )
    else:
        lines.append("")
        lines.append("overlap ratio: n/a (no spans with flowkv.layer: layerwise off)")
    lines.append("")
    lines.append("suggestions:")
    lines.extend(f"- {text}" for text in summary.suggestions)
    return "\n".join(lines)


# --------------------------------------------------------------------------
# timeline
# --------------------------------------------------------------------------


def _lane(span: SpanRecord, by_id: dict[str, SpanRecord]) -> tuple[tuple, str]:
    """(sort key, label) of the lane a span is drawn in."""
    layer = _layer(span)
    layer_text = f" · layer {layer}" if layer is not None else ""
    layer_key = -1 if layer is None else layer
    if span.name == STEP_SPAN:
        return (0, "", 0, -1), "engine step"
    if span.name == WAIT_SPAN:
        return (1, "", 0, -1), "inference: blocked (flowkv.wait)"
    if _is_run_root(span):
        return (2, span.name, 0, layer_key), f"{span.name}{layer_text}"
    if "flowkv.stage" in span.attributes or (
        span.parent_span_id in by_id and _is_run_root(by_id[span.parent_span_id])
    ):
        kind = _stage_kind(span, by_id)
        name = span.attributes.get("flowkv.stage", span.name)
        index = _int_attr(span, "flowkv.stage.index")
        return (3, kind, index, layer_key, str(name)), f"{kind}/{name}{layer_text}" if kind else f"{name}{layer_text}"
    return (4, span.name, 0, layer_key), f"{span.name}{layer_text}"


def _lanes(spans: Sequence[SpanRecord]):
    """Processes, each with ordered lanes of spans: {process: {(key, label): [spans]}}."""
    by_id = {span.span_id: span for span in spans}
    processes: dict[tuple, dict[tuple[tuple, str], list[SpanRecord]]] = defaultdict(lambda: defaultdict(list))
    for span in spans:
        processes[_process_key(span)][_lane(span, by_id)].append(span)
    return processes


def _process_label(process: tuple, number: int) -> str:
    resource = dict(process)
    name = resource.get("service.name", "flowkv")
    pid = resource.get("process.pid")
    return f"{name} (pid {pid})" if pid else f"{name} #{number}"


def _chrome_trace(spans: Sequence[SpanRecord]) -> dict:
    origin = min(span.start_ns for span in spans)
    events: list[dict] = []
    for pid, (process, lanes) in enumerate(sorted(_lanes(spans).items()), start=1):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": _process_label(process, pid)}})
        for tid, ((_, label), lane_spans) in enumerate(sorted(lanes.items()), start=1):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": label}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
            for span in sorted(lane_spans, key=lambda s: s.start_ns):
                events.append(
                    {
                        "ph": "X",
                        "name": span.name,
                        "cat": "flowkv",
                        "pid": pid,
                        "tid": tid,
                        # trace-event times are microseconds; keep nanosecond precision in the fraction
                        "ts": (span.start_ns - origin) / 1000,
                        "dur": span.duration_ns / 1000,
                        "args": {**_jsonable(span.attributes), "trace_id": span.trace_id, "span_id": span.span_id},
                    }
                )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _jsonable(attributes: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in attributes.items()}


_HTML_STYLE = """
body { font: 13px system-ui, sans-serif; margin: 16px; color: #222; }
h1 { font-size: 16px; } h2 { font-size: 14px; margin: 18px 0 6px; }
.row { display: flex; align-items: center; height: 20px; border-bottom: 1px solid #eee; }
.label { width: 300px; flex: none; overflow: hidden; white-space: nowrap; text-overflow: ellipsis; padding-right: 8px; }
.track { position: relative; flex: 1; height: 16px; background: #fafafa; }
.bar { position: absolute; top: 1px; height: 14px; min-width: 1px; opacity: .85; }
.bar:hover { outline: 1px solid #000; opacity: 1; }
.axis { display: flex; justify-content: space-between; margin-left: 300px; color: #666; font-size: 11px; }
.k0 { background: #8c8c8c; } .k1 { background: #d9534f; } .k2 { background: #5b7fbf; }
.k3 { background: #4aa37a; } .k4 { background: #c9a227; }
"""


def _html_page(spans: Sequence[SpanRecord], title: str) -> str:
    origin = min(span.start_ns for span in spans)
    extent = max(max(span.end_ns for span in spans) - origin, 1)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_HTML_STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<p>{len(spans)} spans over {_ms(extent)}. Hover a bar for its span name, duration and attributes.</p>",
    ]
    for number, (process, lanes) in enumerate(sorted(_lanes(spans).items()), start=1):
        parts.append(f"<h2>{html.escape(_process_label(process, number))}</h2>")
        parts.append('<div class="axis">' + "".join(f"<span>{_ms(extent * q / 4)}</span>" for q in range(5)) + "</div>")
        for (key, label), lane_spans in sorted(lanes.items()):
            bars = []
            for span in sorted(lane_spans, key=lambda s: s.start_ns):
                left = 100 * (span.start_ns - origin) / extent
                width = 100 * span.duration_ns / extent
                tip = f"{span.name}  {_ms(span.duration_ns)}\n" + "\n".join(
                    f"{k} = {v}" for k, v in sorted(span.attributes.items())
                )
                bars.append(
                    f'<div class="bar k{key[0]}" style="left:{left:.4f}%;width:{width:.4f}%" '
                    f'title="{html.escape(tip, quote=True)}"></div>'
                )
            parts.append(
                f'<div class="row"><div class="label" title="{html.escape(label, quote=True)}">{html.escape(label)}</div>'
                f'<div class="track">{"".join(bars)}</div></div>'
            )
    parts.append("</body></html>")
    return "\n".join(parts)


def timeline(spans: Sequence[SpanRecord], out_path: str | Path) -> Path:
    """Write a timeline with one lane per stage and layer.

    ``.json`` gives Chrome trace-event JSON (open in https://ui.perfetto.dev
    or chrome://tracing); ``.html`` a self-contained page (no scripts, no
    external resources). Lanes, per process: engine steps, inference-thread
    waits, run roots, then stages by run kind, stage index and layer.
    """
    out_path = Path(out_path)
    suffix = out_path.suffix.lower()
    if suffix not in (".json", ".html", ".htm"):
        raise ValueError(f"timeline output must end in .json (Perfetto/Chrome) or .html, got {out_path.name!r}")
    if not spans:
        raise ValueError("no spans to draw")
    if suffix == ".json":
        out_path.write_text(json.dumps(_chrome_trace(spans)), encoding="utf-8")
    else:
        out_path.write_text(_html_page(spans, f"flowkv timeline: {out_path.stem}"), encoding="utf-8")
    return out_path


# --------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------


def _load(path: str) -> list[SpanRecord]:
    spans = load_spans(path)
    if not spans:
        raise TraceFileError(f"{path}: the file holds no spans")
    return spans


def _run_summarize(args: argparse.Namespace) -> int:
    spans = _load(args.file)
    if args.copy_gbps is not None:
        summary = summarize(spans, copy_gbps=args.copy_gbps, copy_gbps_source="given")
    elif trace_copy_gbps(spans) is None and not args.no_measure:
        # The trace predates the resource attribute (or came from elsewhere): measure here.
        from flowkv.kernels import copy_gbps

        summary = summarize(spans, copy_gbps=round(copy_gbps(), 2), copy_gbps_source="measured by summarize")
    else:
        summary = summarize(spans)
    if args.json:
        print(json.dumps(attrs.asdict(summary), indent=2))
    else:
        print(format_summary(summary))
    return 0


def _run_timeline(args: argparse.Namespace) -> int:
    out = timeline(_load(args.file), args.output)
    print(f"wrote {out}")
    return 0


def _guarded(command):
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except (TraceFileError, ValueError, OSError) as exc:
            print(f"flowkv trace: error: {exc}", file=sys.stderr)
            return 2

    return run


def add_commands(subparsers) -> None:
    """Register ``trace summarize`` and ``trace timeline`` on a CLI's subparsers.

    ``subparsers`` is what ``ArgumentParser.add_subparsers()`` returned;
    each leaf command sets ``func(args) -> int``.
    """
    trace = subparsers.add_parser(
        "trace",
        help="summarize flowkv traces or draw their timeline",
        description="Read flowkv's OTLP/JSON trace files (traces/*.json, or OTLP JSON exported from Jaeger).",
    )
    commands = trace.add_subparsers(dest="trace_command", metavar="{summarize,timeline}", required=True)

    summarize_parser = commands.add_parser(
        "summarize",
        help="per-stage own time, per-layer overlap, and what to tune",
        description=(
            "Print per-stage own time, counts, bytes and bytes per second (transfer stages next to the "
            "machine's copy bandwidth); per-layer transfer vs compute; the overlap ratio "
            "(share of layer transfer time not spent with the inference thread blocked in flowkv.wait); "
            "the slowest stages; and suggested pipeline settings to change, with the likely cause of a slow "
            "transfer (first-touch page faults, thread contention, layout)."
        ),
    )
    summarize_parser.add_argument("file", metavar="FILE", help="OTLP/JSON trace file")
    summarize_parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    summarize_parser.add_argument(
        "--copy-gbps", type=float, default=None, metavar="GBPS",
        help="the copy bandwidth to hold transfers against (default: the one the trace recorded; "
             "for a trace without one, measured now on this machine)")
    summarize_parser.add_argument("--no-measure", action="store_true",
                                  help="never measure the copy bandwidth here")
    summarize_parser.set_defaults(func=_guarded(_run_summarize))

    timeline_parser = commands.add_parser(
        "timeline",
        help="write a timeline (Perfetto JSON or HTML), one lane per stage and layer",
        description=(
            "Write a timeline of the trace: OUT ending in .json gives Chrome trace-event JSON for "
            "ui.perfetto.dev or chrome://tracing; .html a self-contained page."
        ),
    )
    timeline_parser.add_argument("file", metavar="FILE", help="OTLP/JSON trace file")
    timeline_parser.add_argument("-o", "--output", metavar="OUT", required=True, help="output path (.json or .html)")
    timeline_parser.set_defaults(func=_guarded(_run_timeline))


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``trace ...`` commands without the ``flowkv`` console script.

    ``main(["trace", "summarize", "run.json", "--json"])``.
    """
    parser = argparse.ArgumentParser(prog="flowkv")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
