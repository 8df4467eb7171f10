"""``timeline``: a trace drawn as Chrome trace-event JSON (Perfetto) or a self-contained HTML page."""

from __future__ import annotations

import html
import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flowkv.otlp_json import SpanRecord
from flowkv.tracetools.stats import (
    STEP_SPAN,
    WAIT_SPAN,
    _int_attr,
    _is_run_root,
    _layer,
    _process_key,
    _stage_kind,
)
from flowkv.tracetools.text import _ms



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
