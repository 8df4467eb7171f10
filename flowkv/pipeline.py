"""Pipeline files: the model, and loading that explains every mistake.

A pipeline file declares one pipeline set::

    [pipeline]
    name = "local-cpu"
    chunk_size = 256
    hash = "sha256_cbor"

    [tiers.memory]
    kind = "memory"
    capacity = "4GiB"

    [[store.stages]]
    use = "tokenize"
    ...

Loading runs in phases, each pure spec -> spec, and collects every problem
before anything runs: parse the TOML; check the sections and keys; resolve
stage and tier names through the registry; structure each table into its
attrs config class with cattrs (unknown keys rejected); check the whole
pipeline (stage kinds, item facets between neighbours, tier references,
sizes). Each problem is a ``Diagnostic`` printed as ``FILE:LINE:COL: message``.

The model itself (``Pipeline``, ``StageSpec``, ``TierSpec``, ``Diagnostic``,
...) lives in ``flowkv.pipeline_model``; it is re-exported here.
"""

from __future__ import annotations

import importlib.resources
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError

from flowkv import pipeline_model, registry
from flowkv.pipeline_extends import Positions, read_layers
from flowkv.pipeline_model import (
    BlendSpec,
    ControllerSpec,
    Diagnostic,
    LayerwiseSpec,
    Location,
    Pipeline,
    PipelineError,
    PipelineSection,
    QualitySpec,
    StageSpec,
    TelemetrySpec,
    TierGuardSpec,
    TierSpec,
    VllmSpec,
)
from flowkv.registry import Facet, RegistryError, did_you_mean
from flowkv.sizes import parse_size
from flowkv.tenants import check_tenant_name

__all__ = [
    *pipeline_model.__all__,
    "builtin_pipelines",
    "dumps_pipeline",
    "load_pipeline",
    "loads_pipeline",
    "resolve_source",
]

# -- finding pipeline files ----------------------------------------------------


def builtin_pipelines() -> dict[str, Path]:
    """Built-in pipeline files by name (``local-cpu`` -> ``.../local-cpu.toml``)."""
    root = importlib.resources.files("flowkv.pipelines")
    # Resolved: in a checkout flowkv/pipelines is a link to the top-level pipelines/ (for the tools).
    return {
        Path(entry.name).stem: Path(str(entry)).resolve()
        for entry in root.iterdir()
        if entry.name.endswith(".toml")
    }


def resolve_source(name_or_path: str | Path) -> Path:
    """A path to a pipeline file, from a built-in name or a path."""
    candidate = Path(name_or_path)
    if candidate.suffix == ".toml" or candidate.exists() or "/" in str(name_or_path):
        if not candidate.exists():
            raise FileNotFoundError(f"pipeline file not found: {candidate}")
        return candidate
    builtins = builtin_pipelines()
    if str(name_or_path) in builtins:
        return builtins[str(name_or_path)]
    raise FileNotFoundError(
        f"no built-in pipeline named '{name_or_path}'{did_you_mean(str(name_or_path), builtins)} "
        f"(built-ins: {', '.join(sorted(builtins))}; or give a path to a .toml file)"
    )


# -- writing --------------------------------------------------------------------

StageEntry = str | tuple[str, Mapping[str, Any]]


def dumps_pipeline(
    *,
    pipeline: Mapping[str, Any],
    tiers: Mapping[str, Mapping[str, Any]],
    store: list[StageEntry],
    retrieve: list[StageEntry],
    lookup: list[StageEntry] | None = None,
    sections: Mapping[str, Mapping[str, Any]] | None = None,
    server: list[StageEntry] | None = None,
) -> str:
    """TOML text of a pipeline file, for tools and benchmarks that build one.

    A stage is its name, or ``(name, settings)``; values are strings,
    numbers, booleans or lists of those. ``sections`` adds tables such as
    ``telemetry`` or ``layerwise``; ``server`` is a node server's list (its
    file then has no store or retrieve list: pass ``[]``). ``loads_pipeline``
    reads the result back.
    """

    def table(header: str, values: Mapping[str, Any]) -> str:
        return header + "\n" + "".join(f"{key} = {json.dumps(value)}\n" for key, value in values.items())

    parts = [table("[pipeline]", pipeline)]
    parts += [table(f"[tiers.{name}]", values) for name, values in tiers.items()]
    for kind, stages in (("store", store), ("retrieve", retrieve), ("lookup", lookup or []), ("server", server or [])):
        for entry in stages:
            name, settings = (entry, {}) if isinstance(entry, str) else entry
            parts.append(table(f"[[{kind}.stages]]", {"use": name, **settings}))
    parts += [table(f"[{name}]", values) for name, values in (sections or {}).items()]
    return "\n".join(parts)


# -- loading ------------------------------------------------------------------

_SECTIONS = {
    "pipeline": PipelineSection,
    "tiers": None,
    "store": None,
    "retrieve": None,
    "lookup": None,
    "server": None,
    "layerwise": LayerwiseSpec,
    "telemetry": TelemetrySpec,
    "vllm": VllmSpec,
    "quality": QualitySpec,
    "controller": ControllerSpec,
    "blend": BlendSpec,
}
_SIZE_FIELDS = ("capacity", "max_bytes", "slab_size", "max_value_bytes", "prefault_window")


def _make_converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)

    def strict(kind: type) -> Any:
        def structure(value: Any, _: Any) -> Any:
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                return float(value)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ValueError(f"expected {kind.__name__}, got {type(value).__name__} {value!r}")
            return value

        return structure

    for kind in (int, float, str, bool):
        converter.register_structure_hook(kind, strict(kind))
    return converter


_converter = _make_converter()


def load_pipeline(
    source: str | Path, *, overrides: Mapping[str, Any] | None = None, check_quality: bool = True
) -> Pipeline:
    """Load and check a pipeline file (a built-in name or a path).

    ``overrides`` replaces settings by dotted path before checking, e.g.
    ``{"pipeline.chunk_size": 128, "tiers.memory.capacity": "1GiB"}``; a bare
    key (``chunk_size``) means one of ``[pipeline]``.
    Raises ``PipelineError`` listing every problem. ``check_quality=False``
    skips the ``[quality]`` gate (``flowkv quality`` loads a pipeline to
    write the record that gate reads).
    """
    path = resolve_source(source)
    return loads_pipeline(path.read_text(encoding="utf-8"), file=str(path), overrides=overrides,
                          check_quality=check_quality)


def loads_pipeline(
    text: str, *, file: str = "<string>", overrides: Mapping[str, Any] | None = None, check_quality: bool = True
) -> Pipeline:
    """Load and check a pipeline from TOML text."""
    return _Loader(text, file, overrides or {}, check_quality=check_quality).load()


class _Loader:
    def __init__(self, text: str, file: str, overrides: Mapping[str, Any], *, check_quality: bool = True) -> None:
        self.text = text
        self.file = file
        self.overrides = overrides
        self.check_quality = check_quality
        self.diagnostics: list[Diagnostic] = []
        self.positions: Positions = {}
        self.extends: tuple[str, ...] = ()

    def where(self, path: tuple[str | int, ...]) -> tuple[str, int, int]:
        """The file, line and column of ``path`` (or of its nearest ancestor), in the file that wrote it."""
        for depth in range(len(path), 0, -1):
            found = self.positions.get(tuple(path[:depth]))
            if found is not None:
                return found
        return (self.file, 1, 1)

    def error(self, path: tuple[str | int, ...], message: str, kind: str) -> None:
        self.diagnostics.append(Diagnostic(*self.where(path), message, kind))

    def loc(self, path: tuple[str | int, ...]) -> Location:
        return Location(*self.where(path))

    # phase 1: parse (with the files it extends)
    def load(self) -> Pipeline:
        raw, self.positions, self.extends = read_layers(self.text, self.file, builtins=builtin_pipelines,
                                                        problems=self.diagnostics)
        self.apply_overrides(raw)
        pipeline = self.structure(raw)
        if self.diagnostics or pipeline is None:
            raise PipelineError(self.diagnostics)
        return pipeline

    def apply_overrides(self, raw: dict[str, Any]) -> None:
        for dotted, value in self.overrides.items():
            parts = dotted.split(".")
            if len(parts) == 1:
                parts = ["pipeline", *parts]
            table = raw
            for part in parts[:-1]:
                table = table.setdefault(part, {})
                if not isinstance(table, dict):
                    self.diagnostics.append(
                        Diagnostic(self.file, 1, 1, f"override '{dotted}': '{part}' is not a table", "invalid-value")
                    )
                    break
            else:
                table[parts[-1]] = value

    # phases 2-4: sections, names, structure
    def structure(self, raw: dict[str, Any]) -> Pipeline | None:
        for key in raw:
            if key not in _SECTIONS:
                self.error(
                    (key,),
                    f"unknown section '{key}'{did_you_mean(key, _SECTIONS)} "
                    f"(sections: {', '.join(_SECTIONS)})",
                    "unknown-key",
                )
        section = self.structure_table(raw, "pipeline", PipelineSection)
        layerwise = self.structure_table(raw, "layerwise", LayerwiseSpec)
        telemetry = self.structure_table(raw, "telemetry", TelemetrySpec)
        vllm = self.structure_table(raw, "vllm", VllmSpec)
        quality = self.structure_table(raw, "quality", QualitySpec)
        controller = self.structure_table(raw, "controller", ControllerSpec)
        blend = self.structure_table(raw, "blend", BlendSpec) if "blend" in raw else None
        tiers = self.structure_tiers(raw.get("tiers", {}))
        lists: dict[str, tuple[StageSpec, ...]] = {}
        for kind in registry.PIPELINE_KINDS:
            lists[kind] = self.structure_stages(raw, kind)
        if "lookup" not in raw:
            # Without its own list, lookup runs the head of retrieve that may run in lookup.
            head = []
            for spec in lists["retrieve"]:
                if "lookup" not in spec.info.kinds:
                    break
                head.append(spec)
            lists["lookup"] = tuple(head)
        self.check(section, telemetry, tiers, lists, raw)
        self.check_blend(blend, lists, raw)
        if quality is not None:
            self.check_quality_mode(quality)
        if (quality is not None and quality.min_agreement is not None and quality.mode == "enforce"
                and self.check_quality):
            self.check_quality_gate(quality, lists["store"], blend)
        if (section is None or layerwise is None or telemetry is None or vllm is None or quality is None
                or controller is None or ("blend" in raw and blend is None)):
            return None
        return Pipeline(
            name=section.name,
            source=self.file,
            section=section,
            tiers=tiers,
            store=lists["store"],
            retrieve=lists["retrieve"],
            lookup=lists["lookup"],
            layerwise=layerwise,
            telemetry=telemetry,
            vllm=vllm,
            quality=quality,
            controller=controller,
            extends=self.extends,
            origins={".".join(map(str, path)): f"{file}:{line}" for path, (file, line, _) in self.positions.items()},
            blend=blend,
            server=lists["server"],
        )

    def check_blend(self, blend: BlendSpec | None, lists: dict[str, tuple[StageSpec, ...]],
                    raw: dict[str, Any]) -> None:
        """The [blend] table's values, and that every stage reading it has it."""
        for kind, specs in lists.items():
            if kind == "lookup" and "lookup" not in raw:
                continue
            for spec in specs:
                if "blend" in spec.info.reads and "blend" not in raw:
                    self.error((kind, "stages", spec.index, "use"),
                               f"stage '{spec.name}' reads its separator from the [blend] table, which this "
                               "file does not declare (add [blend] with separator = [token ids that close a "
                               "document])", "missing-key")
        if blend is None:
            return
        separator = blend.separator
        if not separator or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**32
                                for t in separator):
            self.error(("blend", "separator"), "[blend] separator must be a non-empty list of token ids "
                       f"(ints in [0, 2**32)), got {separator!r}", "invalid-value")
        if not 0.0 <= blend.recompute_ratio <= 1.0:
            self.error(("blend", "recompute_ratio"), "[blend] recompute_ratio must lie in 0.0..1.0 (0 = plain "
                       f"concatenation, 1 = every reused token recomputed), got {blend.recompute_ratio}",
                       "invalid-value")
        layers = blend.check_layers
        if (not layers or len(set(layers)) != len(layers)
                or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers)):
            self.error(("blend", "check_layers"), "[blend] check_layers must be a non-empty list of distinct "
                       f"layer indices (ints >= 0), got {layers!r}", "invalid-value")

    def check_quality_mode(self, quality: QualitySpec) -> None:
        if quality.mode not in ("enforce", "warn"):
            self.error(("quality", "mode"), "[quality] mode must be \"enforce\" (refuse to load a pipeline the "
                       "record does not show good enough) or \"warn\" (load it; vLLM logs why at start), "
                       f"got {quality.mode!r}", "invalid-value")
        elif quality.mode == "warn" and quality.min_agreement is not None and not 0.0 <= quality.min_agreement <= 1.0:
            self.error(("quality", "min_agreement"),
                       f"[quality] min_agreement must be between 0 and 1, got {quality.min_agreement}", "quality")

    def check_quality_gate(self, quality: QualitySpec, store: tuple[StageSpec, ...],
                           blend: BlendSpec | None) -> None:
        from flowkv.quality_gate import check_gate

        for problem in check_gate(store, min_agreement=quality.min_agreement, record=quality.record,
                                  source=self.file, blend=blend):
            self.error(("quality", "min_agreement"), problem, "quality")

    def structure_table(self, raw: dict[str, Any], key: str, cls: type) -> Any:
        table = raw.get(key, {})
        if not isinstance(table, dict):
            self.error((key,), f"'{key}' must be a table ([{key}])", "invalid-value")
            return None
        return self.structure_config(table, cls, (key,), what=f"[{key}]")

    def structure_config(
        self, table: dict[str, Any], cls: type, path: tuple[str | int, ...], *, what: str
    ) -> Any:
        """Structure ``table`` into ``cls``, reporting each bad key at its line."""
        names = [f.name for f in attrs.fields(cls)]
        table = dict(table)
        for field_name in _SIZE_FIELDS:
            if field_name in table and field_name in names:
                try:
                    table[field_name] = parse_size(table[field_name])
                except ValueError as exc:
                    self.error(path + (field_name,), f"{what} {field_name}: {exc}", "invalid-value")
                    return None
        if "quotas" in table and "quotas" in names:
            quotas = self.structure_quotas(table["quotas"], path + ("quotas",), what)
            if quotas is None:
                return None
            table["quotas"] = quotas
        try:
            return _converter.structure(table, cls)
        except ClassValidationError as group:
            self.report_validation(group, path, what, names)
            # An unknown key must not hide the checks of the keys that were right
            # (chunk_size = 0 next to a typo): the load fails anyway, but says everything.
            known = {k: v for k, v in table.items() if k in names}
            if len(known) < len(table):
                try:
                    return _converter.structure(known, cls)
                except Exception:
                    pass
        except Exception as exc:  # an attrs validator or __attrs_post_init__ refused it
            self.error(path, f"{what}: {exc}", "invalid-value")
        return None

    def structure_quotas(self, raw: Any, path: tuple[str | int, ...], what: str) -> dict[str, int] | None:
        """``quotas = { default = "1GiB", acme = "8GiB" }``: tenant names to sizes, each mistake at its key."""
        if not isinstance(raw, dict):
            self.error(path, f'{what} quotas: expected a table of tenant = size, e.g. '
                             f'{{ default = "1GiB", acme = "8GiB" }}, got {type(raw).__name__}', "invalid-value")
            return None
        quotas: dict[str, int] = {}
        good = True
        for tenant, size in raw.items():
            why = check_tenant_name(tenant)
            if why is not None:
                self.error(path + (tenant,), f"{what} quotas: {why}", "invalid-value")
                good = False
                continue
            try:
                quotas[tenant] = parse_size(size)
            except ValueError as exc:
                self.error(path + (tenant,), f"{what} quotas.{tenant}: {exc}", "invalid-value")
                good = False
                continue
            if quotas[tenant] == 0:
                self.error(path + (tenant,), f"{what} quotas.{tenant}: a quota must be above 0 B "
                                             "(leave the tenant out to give it the default)", "invalid-value")
                good = False
        return quotas if good else None

    def report_validation(
        self,
        group: BaseException,
        path: tuple[str | int, ...],
        what: str,
        names: list[str],
    ) -> None:
        for exc, note in _leaves(group):
            if isinstance(exc, ForbiddenExtraKeysError):
                for extra in sorted(exc.extra_fields):
                    self.error(
                        path + (extra,),
                        f"{what}: unknown key '{extra}'{did_you_mean(extra, names)} "
                        f"(valid keys: {', '.join(names) or 'none'})",
                        "unknown-key",
                    )
            elif isinstance(exc, KeyError) and note is not None:
                self.error(path, f"{what}: missing required key '{note}'", "missing-key")
            else:
                field_path = path + ((note,) if note else ())
                label = f"{what} {note}" if note else what
                self.error(field_path, f"{label}: {_plain(exc)}", "invalid-value")

    def structure_tiers(self, tables: Any) -> dict[str, TierSpec]:
        tiers: dict[str, TierSpec] = {}
        if not isinstance(tables, dict):
            self.error(("tiers",), "'tiers' must hold [tiers.NAME] tables", "invalid-value")
            return tiers
        for name, table in tables.items():
            path = ("tiers", name)
            if not isinstance(table, dict):
                self.error(path, f"tier '{name}' must be a table [tiers.{name}]", "invalid-value")
                continue
            kind = table.get("kind", name if name in registry.BUILTIN_TIERS else None)
            if kind is None:
                self.error(path, f"tier '{name}': missing required key 'kind'", "missing-key")
                continue
            try:
                info = registry.resolve_tier(kind)
            except RegistryError as exc:
                self.error(
                    path + (("kind",) if "kind" in table else ()),
                    f"tier '{name}': {exc}",
                    "unknown-tier" if exc.kind == "unknown" else exc.kind,
                )
                continue
            # Byte tiers run behind a health guard and a write-behind queue; object tiers (memory) do not.
            guard_keys = [f.name for f in attrs.fields(TierGuardSpec)] if info.holds == "bytes" else []
            options = {k: v for k, v in table.items() if k != "kind" and k not in guard_keys}
            guard = self.structure_config(
                {k: v for k, v in table.items() if k in guard_keys}, TierGuardSpec, path, what=f"tier '{name}'"
            )
            config = self.structure_config(options, info.config_cls, path, what=f"tier '{name}'")
            if config is not None and guard is not None:
                tiers[name] = TierSpec(name, kind, info, config, self.loc(path), guard)
        return tiers

    def structure_stages(self, raw: dict[str, Any], kind: str) -> tuple[StageSpec, ...]:
        section = raw.get(kind)
        if section is None:
            return ()
        if not isinstance(section, dict) or set(section) - {"stages"}:
            extra = sorted(set(section) - {"stages"}) if isinstance(section, dict) else []
            for key in extra:
                hint = (" (replace = [...] works in a file that says extends = ...)" if key == "replace"
                        else f"{did_you_mean(key, ['stages'])} (declare stages as [[{kind}.stages]] tables)")
                self.error((kind, key), f"[{kind}]: unknown key '{key}'{hint}", "unknown-key")
            if not isinstance(section, dict):
                self.error((kind,), f"'{kind}' must hold [[{kind}.stages]] tables", "invalid-value")
                return ()
        stages = section.get("stages", [])
        if not isinstance(stages, list):
            self.error((kind, "stages"), f"'{kind}.stages' must be an array of tables", "invalid-value")
            return ()
        specs = []
        for index, table in enumerate(stages):
            path = (kind, "stages", index)
            if not isinstance(table, dict):
                self.error(path, f"[[{kind}.stages]] #{index + 1} must be a table", "invalid-value")
                continue
            use = table.get("use")
            if "use" in table and not isinstance(use, str):
                self.error(path + ("use",), f"[[{kind}.stages]] #{index + 1}: 'use' must be a string "
                           f"naming the stage, got {type(use).__name__} {use!r}", "invalid-value")
                continue
            if not isinstance(use, str):
                self.error(path, f"[[{kind}.stages]] #{index + 1}: missing required key 'use' "
                           "(the stage name)", "missing-key")
                continue
            try:
                info = registry.resolve_stage(use)
            except RegistryError as exc:
                self.error(
                    path + ("use",),
                    str(exc),
                    "unknown-stage" if exc.kind == "unknown" else exc.kind,
                )
                continue
            settings = {k: v for k, v in table.items() if k != "use"}
            config = self.structure_config(settings, info.config_cls, path, what=f"stage '{use}'")
            if config is not None:
                specs.append(StageSpec(use, info, config, index, self.loc(path)))
        return tuple(specs)

    # phase 5: the whole pipeline
    def check(
        self,
        section: PipelineSection | None,
        telemetry: TelemetrySpec | None,
        tiers: dict[str, TierSpec],
        lists: dict[str, tuple[StageSpec, ...]],
        raw: dict[str, Any],
    ) -> None:
        section = section or PipelineSection()
        telemetry = telemetry or TelemetrySpec()
        if section.chunk_size <= 0:
            self.error(("pipeline", "chunk_size"),
                       f"chunk_size must be positive, got {section.chunk_size}", "invalid-value")
        if section.hash != "auto":
            try:
                from flowkv.keys import get_hash_function

                get_hash_function(section.hash)
            except ImportError:
                pass
            except (ValueError, KeyError) as exc:
                self.error(("pipeline", "hash"), _plain(exc), "invalid-value")
        if not 0.0 <= telemetry.sampling <= 1.0:
            self.error(("telemetry", "sampling"),
                       f"sampling must be between 0 and 1, got {telemetry.sampling}", "invalid-value")
        if telemetry.exporter == "otlp" and not telemetry.endpoint:
            self.error(("telemetry", "exporter"),
                       "exporter 'otlp' needs an endpoint (e.g. endpoint = \"http://localhost:4317\")",
                       "missing-key")
        object_tiers = [name for name, spec in tiers.items() if spec.info.holds == "objects"]
        if "server" in raw:
            self.check_server_file(raw)
        elif tiers and not object_tiers:
            self.error(("tiers",), "declare a tier that holds objects, of kind 'memory' or 'server' (found none): "
                       "store stages chunks in the first one", "graph")
        # Object tiers of different kinds may chain (memory -> server: a copy step between them);
        # two of one kind would hold the same chunks twice in the same place.
        by_kind: dict[str, list[str]] = {}
        for name in object_tiers:
            by_kind.setdefault(tiers[name].kind, []).append(name)
        for kind, names in by_kind.items():
            if len(names) > 1:
                self.error(("tiers", names[1]), f"declare at most one tier of kind '{kind}' (found {len(names)}: "
                           f"{', '.join(names)}): object tiers of one kind would hold the same chunks twice", "graph")
        if "tiers" in raw and not raw["tiers"]:
            self.error(("tiers",), "declare at least one tier", "missing-key")
        for kind, specs in lists.items():
            if kind == "lookup" and "lookup" not in raw:
                continue  # the head of [[retrieve.stages]], checked (and reported) there
            self.check_list(kind, specs, tiers)
        layerwise = raw.get("layerwise", {})
        if isinstance(layerwise, dict) and layerwise.get("enabled") is True:
            for kind in ("store", "retrieve"):
                self.check_layer_segment(kind, lists[kind])

    def check_server_file(self, raw: dict[str, Any]) -> None:
        """A file with a [server] list is a node server's: the server's arena is its object tier (it
        declares none, or a memory tier for its tenants' quotas), and it runs no engine lists."""
        for kind in ("store", "retrieve", "lookup"):
            if kind in raw:
                file, line, col = self.where((kind,))
                self.error(("server",), f"[server]: a file with a [server] list is a node server's pipeline "
                           f"(`flowkv server --pipeline`), which runs no {kind} list, but this one has one "
                           f"({file}:{line}:{col}): drop it (and an extends of an engine's pipeline); vLLM uses "
                           "a pipeline with a tier of kind 'server' (such as node or node-disk)", "graph")

    def check_layer_segment(self, kind: str, specs: tuple[StageSpec, ...]) -> None:
        """Layerwise lists run as head (once), per-layer stages (each layer), tail (once)."""
        positions = [i for i, spec in enumerate(specs) if spec.info.per_layer]
        if not positions:
            self.error(("layerwise", "enabled"),
                       f"layerwise is on but [[{kind}.stages]] has no per-layer stage "
                       f"(such as '{'gather' if kind == 'store' else 'scatter'}')", "graph")
            return
        if positions != list(range(positions[0], positions[-1] + 1)):
            gap = next(i for i in range(positions[0], positions[-1]) if i not in positions)
            self.error((kind, "stages", specs[gap].index, "use"),
                       f"stage '{specs[gap].name}' sits between per-layer stages of [[{kind}.stages]]: "
                       "a layerwise list runs its per-layer stages as one block", "graph")

    def check_list(self, kind: str, specs: tuple[StageSpec, ...], tiers: dict[str, TierSpec]) -> None:
        given: set[str] = set(_SOURCE_GIVES.get(kind, {Facet.REQUEST}))
        # A server's arena is its tier "memory", declared or not.
        known_tiers = [*tiers, *(["memory"] if kind == "server" and "memory" not in tiers else [])]
        for spec in specs:
            path = (kind, "stages", spec.index)
            if kind not in spec.info.kinds:
                self.error(path + ("use",),
                           f"stage '{spec.name}' cannot run in a {kind} pipeline "
                           f"(it runs in: {_kinds(spec)})", "graph")
            missing = spec.info.needs - given
            if missing:
                providers = _providers(missing)
                hint = f" (add {' or '.join(repr(p) for p in providers)} before it)" if providers else ""
                self.error(path + ("use",),
                           f"stage '{spec.name}' needs {', '.join(sorted(missing))}, which no earlier "
                           f"stage in [[{kind}.stages]] gives{hint}", "graph")
            given |= spec.info.gives
            for field_name, value in spec.settings().items():
                if field_name not in ("tier", "tiers") or value is None:
                    continue
                for tier_name in [value] if isinstance(value, str) else list(value):
                    if tier_name not in known_tiers:
                        self.error(path + (field_name,),
                                   f"stage '{spec.name}': tier '{tier_name}' is not declared"
                                   f"{did_you_mean(tier_name, known_tiers)} (declare [tiers.{tier_name}])",
                                   "unknown-tier")


# What a list's source items carry: a request (store, retrieve, lookup), or for a node server's list
# the chunks clients committed to its arena: keyed, in their buffer, with their KV.
_SOURCE_GIVES: dict[str, frozenset[Facet]] = {"server": frozenset({Facet.KEY, Facet.BUFFER, Facet.KV})}


def _kinds(spec: StageSpec) -> str:
    """The lists a stage may run in, in the order a file declares them."""
    return ", ".join(kind for kind in registry.PIPELINE_KINDS if kind in spec.info.kinds)


def _providers(facets: set[str] | frozenset[str]) -> list[str]:
    names = []
    for name in registry.BUILTIN_STAGES:
        try:
            info = registry.resolve_stage(name)
        except RegistryError:
            continue
        if info.gives & facets:
            names.append(name)
    return names


def _leaves(exc: BaseException, note: str | None = None):
    """(exception, field name) for every leaf of a cattrs validation group."""
    if isinstance(exc, BaseExceptionGroup) and not isinstance(exc, ForbiddenExtraKeysError):
        for sub in exc.exceptions:
            sub_note = note
            for n in getattr(sub, "__notes__", []):
                name = getattr(n, "name", None)
                if name is not None:
                    sub_note = name
            yield from _leaves(sub, sub_note)
    else:
        yield exc, note


def _plain(exc: BaseException) -> str:
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    return str(exc) or type(exc).__name__
