"""``suggest``: which pipeline setting to change, by rule, from a trace summary."""

from __future__ import annotations

from flowkv.registry import Role
from flowkv.tracetools.stats import StageStats, Summary
from flowkv.tracetools.text import _bytes, _ms

# Thresholds of the suggestion rules (see ``suggest``).
LOW_OVERLAP = 0.5
VERY_LOW_OVERLAP = 0.2
GOOD_OVERLAP = 0.9
DOMINANT_SHARE = 0.3  # a stage taking this share of its run kind's own time
SMALL_ITEM_BYTES = 1 << 20  # per-item cost shows when items are smaller than this
SMALL_CHUNK_BYTES = 256 << 10  # a tier call moving less than this is call-bound
MISSING_TIER_SHARE = 0.2
STEP_SHARE_FOR_LAYERWISE = 0.2
MIN_ITEMS_FOR_SMALL = 16
FAR_BELOW_COPY = 0.5  # a transfer stage slower than this share of the machine's copy bandwidth
FAULTED_SHARE = 0.25  # of a transfer's bytes landing on pages it faulted in: first-touch faults
CONTENDED_CPU_SHARE = 0.75  # the transferring thread on a core less than this share of the time
SHORT_ROW_BYTES = 4096  # rows shorter than this make a gather/scatter slower than a copy
SHORT_CALL_NS = 250_000  # a transfer call this short at copy speed pays mostly its fixed cost
_PAGE_BYTES = 4096


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
    5. **Codec dominates.** A stage of role codec (compress, decompress, a
       third-party codec) takes at least [DOMINANT_SHARE] of its run kind's
       own time: pick a faster codec, or none.
    6. **Small items.** A stage (not a tier stage: rule 7) with at least [DOMINANT_SHARE] of
       its kind's own time, at least [MIN_ITEMS_FOR_SMALL] items, and
       under [SMALL_ITEM_BYTES] per item on average: raise ``chunk_size``
       (items are chunks; no stage has a batch size of its own).
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
        if stage.role == Role.CODEC:
            advice.append(
                f"Codec stage {label} takes {stage.share:.0%} of {stage.kind or 'its'} time: "
                "choose a faster codec (or none) for this pipeline."
            )
            continue
        per_item = stage.total_bytes / stage.items_out if stage.items_out and stage.total_bytes else None
        if per_item is None:
            continue
        # No stage has a batch size of its own: the chunk is the item, so chunk_size is the lever
        # (a tier stage gets rule 7's advice instead).
        if stage.items_out >= MIN_ITEMS_FOR_SMALL and per_item < SMALL_ITEM_BYTES and not stage.tiers:
            advice.append(
                f"Stage {label} takes {stage.share:.0%} of {stage.kind or 'its'} time on small items "
                f"({_bytes(per_item)} each), paying its per-item cost for each: raise `chunk_size` so each "
                "item carries more (prefix hits become coarser)."
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
