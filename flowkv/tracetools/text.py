"""``format_summary``: a trace summary as plain text for a terminal."""

from __future__ import annotations

from flowkv.tracetools.stats import Summary



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
    if summary.blend is not None:
        blend = summary.blend
        share = "-" if blend.recompute_share is None else f"{blend.recompute_share:.1%}"
        lines.append("")
        lines.append(f"blend: {blend.blends} load{'s' if blend.blends != 1 else ''}, {blend.reused_tokens} tokens "
                     f"reused, {blend.recomputed_tokens} recomputed ({share}), {_ms(blend.load_ns)}: "
                     + ", ".join(f"{step} {_ms(ns)}" for step, ns in blend.step_ns.items()))
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
