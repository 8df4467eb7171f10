"""The pipeline model: what a loaded pipeline file is, and what is wrong with one.

Plain attrs classes, with no behaviour beyond their fields, so that every
part of flowkv (the loader, the runner, telemetry, the engine, tools) can
name them without importing the loader. ``flowkv.pipeline`` builds them from
TOML and re-exports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import attrs

if TYPE_CHECKING:
    from flowkv.registry import StageInfo, TierInfo

__all__ = [
    "BlendSpec",
    "ControllerSpec",
    "Diagnostic",
    "LayerwiseSpec",
    "Location",
    "Pipeline",
    "PipelineError",
    "PipelineSection",
    "QualitySpec",
    "StageSpec",
    "TelemetrySpec",
    "TierGuardSpec",
    "TierSpec",
    "VllmSpec",
]


@attrs.frozen
class Location:
    """Where a thing was declared."""

    file: str
    line: int
    col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"

    @property
    def short(self) -> str:
        return f"{self.file}:{self.line}"


@attrs.frozen
class StageSpec:
    """One ``[[store.stages]]`` (or retrieve/lookup/server) table, resolved and structured."""

    use: str  # the name as written
    info: StageInfo
    config: Any  # instance of info.config_cls: every effective setting, defaults included
    index: int  # position in its list
    location: Location

    @property
    def name(self) -> str:
        return self.info.name

    def settings(self) -> dict[str, Any]:
        return attrs.asdict(self.config, recurse=False)


@attrs.frozen(kw_only=True)
class TierGuardSpec:
    """Keys every byte tier's table accepts besides its kind's own (see ``flowkv.tiers.base``)."""

    timeout_s: float = 1.0  # every call to the tier is cut off after this
    backoff_max_s: float = 30.0  # a failed tier is retried after at most this long
    write_queue: int = 256  # chunks held for write-behind (waiting or being written); more are dropped and counted


@attrs.frozen
class TierSpec:
    """One ``[tiers.NAME]`` table."""

    name: str
    kind: str
    info: TierInfo
    config: Any  # instance of info.config_cls
    location: Location
    guard: TierGuardSpec = TierGuardSpec()


@attrs.frozen
class PipelineSection:
    name: str = "unnamed"
    chunk_size: int = 256
    # Chunk hash function; "auto" is vLLM's sha256_cbor when vLLM imports, else sha256.
    hash: str = "auto"
    # Store the last chunk of a request even when it holds fewer than chunk_size tokens.
    save_partial_chunks: bool = False
    # Pins taken by lookup are dropped after this long if no retrieve comes.
    pin_timeout_s: float = 30.0
    description: str = ""


@attrs.frozen
class LayerwiseSpec:
    enabled: bool = False


@attrs.frozen
class TelemetrySpec:
    exporter: Literal["none", "console", "otlp", "file"] = "none"
    endpoint: str | None = None  # otlp: e.g. "http://localhost:4317"
    protocol: Literal["grpc", "http/protobuf"] = "grpc"
    folder: str = "traces"  # file: where OTLP-JSON trace files go
    sampling: float = 1.0  # fraction of runs traced
    service_name: str = "flowkv"


@attrs.frozen
class VllmSpec:
    """Settings the vLLM connector reads."""

    save_decode: bool = False  # also store KV of generated tokens
    lookup_timeout_ms: int = 200  # the scheduler answers 0 hits past this
    # A decode request whose prefill instance named committed KV waits this long for the tier to hold it
    # (write-behind tiers commit later than the prefill instance answered); past it, it loads what is there.
    remote_prefill_wait_ms: int = 10_000


@attrs.frozen
class ControllerSpec:
    """``[controller]``: report this instance's chunks to a ``flowkv controller`` (off while ``url`` is unset)."""

    url: str | None = None  # e.g. "http://127.0.0.1:9100"
    instance_id: str | None = None  # default: advertise_url's host:port, else the host name and vLLM's instance id
    advertise_url: str | None = None  # where this instance serves requests, for `flowkv route`
    heartbeat_s: float = 2.0
    token_file: str | None = None  # an instance token of the controller
    ca_file: str | None = None  # an https:// controller's CA bundle (default: the system's)
    max_queue: int = 100_000  # events waiting to be sent; past this they are dropped and counted
    kv_events: bool = True  # also publish tier events as vLLM KV events (when vLLM's --kv-events-config is on)


@attrs.frozen
class QualitySpec:
    """``[quality]``: the output quality a pipeline with lossy codecs must have shown.

    With ``min_agreement`` set, the loader refuses the pipeline unless the
    quality record at ``record`` (written by ``flowkv quality``; a path
    relative to the pipeline file) measured every lossy codec of the store
    list, with these parameters, at or above that greedy-token agreement.
    Lossless-only pipelines pass without a record. A ``[blend]`` pipeline is
    gated too (CacheBlend's output is approximate): its record must measure
    ``blend`` at the pipeline's ``recompute_ratio`` and ``check_layers``.
    ``mode = "warn"`` turns each refusal into a warning vLLM logs at start
    (the built-in ``blend`` ships so: no record of the model you serve exists).
    """

    min_agreement: float | None = None  # 0..1, e.g. 0.95
    record: str | None = None  # path to the quality record JSON
    mode: str = "enforce"  # enforce: refuse to load; warn: load, and vLLM logs why at start


@attrs.frozen(kw_only=True)
class BlendSpec:
    """``[blend]``: documents reused wherever they sit in a prompt (CacheBlend).

    A pipeline with this table blends: the ``segment`` stage cuts requests
    after each ``separator`` and keys each segment by its own tokens. Checked
    by the loader (``separator`` non-empty token ids, ``recompute_ratio`` in
    0..1, ``check_layers`` non-negative layer indices).
    """

    separator: list[int]  # token ids that close a document (e.g. the ids of "\n\n")
    recompute_ratio: float = 0.15  # share of reused tokens recomputed: 0 = plain concatenation, 1 = all
    check_layers: list[int] = attrs.Factory(lambda: [1])  # layers where deviating tokens are selected


@attrs.frozen
class Pipeline:
    """A loaded, checked pipeline set."""

    name: str
    source: str  # file path, or "<string>"
    section: PipelineSection
    tiers: dict[str, TierSpec]  # in declaration order = lookup order
    store: tuple[StageSpec, ...]
    retrieve: tuple[StageSpec, ...]
    lookup: tuple[StageSpec, ...]
    layerwise: LayerwiseSpec
    telemetry: TelemetrySpec
    vllm: VllmSpec
    quality: QualitySpec = QualitySpec()
    controller: ControllerSpec = ControllerSpec()
    extends: tuple[str, ...] = ()  # the files this one extends, nearest first
    # Where each table and key was written: "pipeline.chunk_size" -> "FILE:LINE" (defaults have none).
    origins: dict[str, str] = attrs.field(factory=dict, eq=False, repr=False)
    blend: BlendSpec | None = None  # [blend]; None: no blending
    # [[server.stages]]: a node server's pipeline runs these on each chunk a client commits to its
    # arena (on its writer thread: e.g. compress, then put to the lower tiers). Such a file has no
    # store, retrieve or lookup list: vLLM uses a pipeline with a tier of kind "server".
    server: tuple[StageSpec, ...] = ()

    @property
    def chunk_size(self) -> int:
        return self.section.chunk_size

    def stages(self, kind: str) -> tuple[StageSpec, ...]:
        return {"store": self.store, "retrieve": self.retrieve, "lookup": self.lookup, "server": self.server}[kind]

    def store_codec(self) -> tuple[str, dict[str, Any]]:
        """The codec and the parameters set for it of the store list's first codec stage (by its
        declared role: an encoder, giving ``payload``); ``("none", {})`` when the list has none."""
        for spec in self.store:
            if spec.info.role == "codec" and "payload" in spec.info.gives:
                for codec, params in spec.info.encodings_of(spec.config)[:1]:
                    return codec, dict(params)
        return "none", {}


# -- what is wrong with a pipeline file -----------------------------------------


@attrs.frozen
class Diagnostic:
    file: str
    line: int
    col: int
    message: str
    # syntax, unknown-key, missing-key, invalid-value, unknown-stage, unknown-tier,
    # module-not-found, attribute-not-found, misuse, duplicate, graph, quality
    kind: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}: {self.message}"


class PipelineError(ValueError):
    """Every problem found in a pipeline file, one ``FILE:LINE:COL: message`` per line."""

    def __init__(self, diagnostics: list[Diagnostic]) -> None:
        self.diagnostics = sorted(diagnostics, key=lambda d: (d.file, d.line, d.col))
        super().__init__("\n".join(str(d) for d in self.diagnostics))
