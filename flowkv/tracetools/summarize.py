"""``summarize``: per-stage own time, bytes and rates, per-tier hits, per-layer overlap, from a trace's spans."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import attrs

from flowkv.otlp_json import SpanRecord
from flowkv.registry import RegistryError, Role, builtin_role
from flowkv.tracetools.advice import suggest
from flowkv.tracetools.stats import (
    _PROBE_ATTRIBUTES,
    COPY_GBPS_ATTRIBUTE,
    STEP_SPAN,
    WAIT_SPAN,
    LayerStats,
    StageStats,
    Summary,
    TierStats,
    blend_stats,
    _int_attr,
    _intersection_length,
    _is_run_root,
    _layer,
    _length,
    _process_key,
    _stage_kind,
    _stage_spans,
    _union,
)



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
                           "probe": None, "rows": None, "role": _role(span, name)}
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
                    transfer=e["role"] == Role.TRANSFER or e["probe"] is not None,
                    faults=None if e["probe"] is None else e["probe"][0],
                    cpu_ns=None if e["probe"] is None else e["probe"][1],
                    preempted=None if e["probe"] is None else e["probe"][2],
                    row_bytes=e["rows"],
                    role=e["role"],
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
        blend=blend_stats(spans),
    )
    return attrs.evolve(summary, suggestions=tuple(suggest(summary)))


def _role(span: SpanRecord, name: str) -> str:
    """What the stage of a span is: the role it recorded, else (older traces) a built-in's declared role."""
    role = span.attributes.get("flowkv.stage.role")
    if isinstance(role, str):
        return role
    try:
        return str(builtin_role(name) or "")
    except RegistryError:
        return ""
