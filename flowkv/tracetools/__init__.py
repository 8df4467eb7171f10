"""``flowkv trace summarize|timeline``: read flowkv's traces and say where time goes.

The package, by what each part does: ``summarize`` (per-stage, per-tier and
per-layer figures), ``advice`` (which setting to change, by rule), ``text``
(the summary for a terminal), ``timeline`` (Perfetto JSON or HTML), ``cli``
(the commands); ``stats`` holds what a summary is and the span readers they share.

Input is any list of ``SpanRecord`` (``flowkv.otlp_json.load_spans`` reads
the OTLP/JSON files that ``[telemetry] exporter = "file"`` writes, or OTLP
JSON exported from Jaeger). The span names and attributes read here are the
ones ``docs/internals.md`` fixes:

* a run root ``flowkv.store`` / ``flowkv.retrieve`` / ``flowkv.lookup``
  (``flowkv.promote``: a promoted chunk's decode, nested in the ``get`` that
  promoted it, whose own time includes it; ``flowkv.server``: a node server's
  writer);
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


from flowkv.tracetools.advice import suggest
from flowkv.tracetools.cli import add_commands, main
from flowkv.tracetools.stats import LayerStats, StageStats, Summary, TierStats
from flowkv.tracetools.summarize import summarize, trace_copy_gbps
from flowkv.tracetools.text import format_summary
from flowkv.tracetools.timeline import timeline

__all__ = [
    "LayerStats",
    "StageStats",
    "Summary",
    "TierStats",
    "add_commands",
    "format_summary",
    "main",
    "suggest",
    "summarize",
    "timeline",
    "trace_copy_gbps",
]
