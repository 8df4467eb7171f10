"""Stages and tiers by name.

Three ways to name a stage or tier kind in a pipeline file:

- a built-in short name (``gather``, ``disk``), registered below as
  name -> ``"module:attribute"`` and imported only when first used;
- a third-party name from the ``flowkv.plugins`` entry-point group of an
  installed distribution, loaded only when used (the older group
  ``flowkv.stages`` still works, with a ``DeprecationWarning`` when used);
- a one-off ``"pkg.module:name"`` reaching user code directly.

Misuse of the decorators is caught where it happens, with the function's
``file:line`` in the message.
"""

from __future__ import annotations

import difflib
import enum
import importlib
import importlib.metadata
import inspect
import os
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import attrs

ENTRY_POINT_GROUP = "flowkv.plugins"
# The group's first name: still read, with a DeprecationWarning when one of its names is used.
DEPRECATED_ENTRY_POINT_GROUP = "flowkv.stages"
# The stage lists of a pipeline file; "server" is a node server's: it runs on each chunk a client
# committed to the server's arena, on the server's writer thread (encode, then write the lower tiers).
PIPELINE_KINDS = ("store", "retrieve", "lookup", "server")
# Top-level pipeline tables a stage may declare it reads (``@stage(reads=...)``).
READABLE_TABLES = ("blend",)

# Built-in stages: name -> "module:attribute", imported lazily.
BUILTIN_STAGES: dict[str, str] = {
    "tokenize": "flowkv.stages.chunking:tokenize",
    "chunk-hash": "flowkv.stages.chunking:chunk_hash",
    "allocate": "flowkv.stages.tiering:allocate",
    "gather": "flowkv.stages.transfer:gather",
    "compress": "flowkv.stages.codec:compress",
    "put": "flowkv.stages.tiering:put",
    "lookup": "flowkv.stages.tiering:lookup",
    "get": "flowkv.stages.tiering:get",
    "decompress": "flowkv.stages.codec:decompress",
    "scatter": "flowkv.stages.transfer:scatter",
    "pass-through": "flowkv.stages.basic:pass_through",
    "take": "flowkv.stages.basic:take",
    "segment": "flowkv.stages.chunking:segment",
}

# Built-in tier kinds: name -> "module:attribute", imported lazily.
BUILTIN_TIERS: dict[str, str] = {
    "memory": "flowkv.tiers.memory:MemoryTier",
    "disk": "flowkv.tiers.disk:DiskTier",
    "redis": "flowkv.tiers.redis:RedisTier",
    "server": "flowkv.tiers.server:ServerTier",
}


class Role(enum.StrEnum):
    """What a stage does in a run; the parts of flowkv that must know a stage ask this, never its name."""

    CHUNKER = "chunker"  # cuts each request into fixed-size chunks (span from request)
    SEGMENTER = "segmenter"  # cuts each request where its content says (span from request)
    KEYER = "keyer"  # gives each chunk its key
    LOOKUP = "lookup"  # finds which chunks the tiers hold, moving no data
    ALLOCATOR = "allocator"  # takes room for each chunk's KV
    TRANSFER = "transfer"  # copies KV between the engine's paged cache and chunk buffers
    CODEC = "codec"  # encodes KV into payloads, or decodes them back
    TIER_IO = "tier-io"  # writes chunks into tiers, or reads them out
    FLOW = "flow"  # passes items on without looking at them (pass-through, take)
    OTHER = "other"  # a stage that declares no role


class Facet(enum.StrEnum):
    """What an item carries once a stage gave it; ``needs`` and ``gives`` name these (plain strings work)."""

    REQUEST = "request"  # the source item of every run
    SPAN = "span"  # a chunk's token range
    KEY = "key"  # the chunk's cache key
    BUFFER = "buffer"  # a memory object allocated for the chunk's KV
    KV = "kv"  # the chunk's KV tensor is filled
    PAYLOAD = "payload"  # the chunk's KV encoded as bytes
    HIT = "hit"  # a tier holds the chunk
    LOADED = "loaded"  # the chunk's KV is written into the engine's paged cache
    STORED = "stored"  # the chunk is written into its tiers (``put``)


def _facets(values: Iterable[str], where: str, stage_name: str) -> frozenset[Facet]:
    out = set()
    for value in values:
        try:
            out.add(Facet(value))
        except ValueError:
            raise RegistryError(
                f"stage '{stage_name}' ({where}): unknown facet '{value}'"
                f"{did_you_mean(str(value), [f.value for f in Facet])}; facets are {[f.value for f in Facet]}",
                kind="misuse",
            ) from None
    return frozenset(out)


class RegistryError(Exception):
    """A stage or tier could not be found or registered."""

    def __init__(self, message: str, *, kind: str = "not-found") -> None:
        super().__init__(message)
        self.kind = kind  # "unknown", "module-not-found", "attribute-not-found", "duplicate", "misuse"


def _where(obj: Any) -> str:
    try:
        # Resolved: in a checkout flowkv/stages is a link to the top-level stages/ (for the tools).
        file = os.path.realpath(inspect.getsourcefile(obj) or "?")
        line = inspect.getsourcelines(obj)[1]
        return f"{file}:{line}"
    except (OSError, TypeError):
        return getattr(obj, "__module__", "?")


@attrs.frozen
class StageInfo:
    """What the registry knows of one stage."""

    name: str
    func: Callable[..., Any]
    kinds: frozenset[str]  # pipeline lists it may appear in
    needs: frozenset[str]  # item facets it reads
    gives: frozenset[str]  # item facets it adds
    config_cls: type  # attrs class of its settings (made from the signature when not given)
    takes_ctx: bool  # the runner passes ctx= only when the function declares it
    origin: str  # "module.qualname (file:line)"
    # Layerwise pipelines run this stage once per layer (ctx.layer set), the others once.
    per_layer: bool = False
    role: Role = Role.OTHER
    # A chunker or keyer that lets hashes made outside the engine (vLLM's scheduler) stand for
    # the tokens: fixed-size chunks keyed through ``services.chunk_keys``. Flow stages pass.
    accepts_hashes: bool = False
    # Whether the KV that comes out may differ from what went in (a lossy codec, a blend):
    # such a stage answers to the [quality] gate. A callable decides from the stage's config.
    lossy: bool | Callable[[Any], bool] = False
    # What a codec (or another lossy stage) writes, as quality records name it: its config to
    # [(codec, parameters set)]. Default: the stage's own name and its settings that are set.
    encodings: Callable[[Any], list[tuple[str, dict[str, Any]]]] | None = None
    # A stage declared with config= whose function takes ``config``: it gets the instance, so the
    # settings are written once (the attrs class), not again as keyword parameters.
    takes_config: bool = False
    # Top-level tables of the pipeline file it reads through ctx.services (e.g. "blend");
    # the loader refuses a pipeline that uses the stage without them.
    reads: frozenset[str] = frozenset()

    def make_config(self, **settings: Any) -> Any:
        return self.config_cls(**settings)

    def is_lossy(self, config: Any) -> bool:
        return bool(self.lossy(config) if callable(self.lossy) else self.lossy)

    def encodings_of(self, config: Any) -> list[tuple[str, dict[str, Any]]]:
        """What this stage with this config writes, as quality records name it: its declared
        ``encodings``, else its own name and the settings that are set."""
        if self.encodings is not None:
            return list(self.encodings(config))
        settings = {k: v for k, v in attrs.asdict(config, recurse=False).items() if v is not None}
        return [(self.name, settings)]

    def config_kwargs(self, config: Any) -> dict[str, Any]:
        """What the runner passes the function: ``config=`` the instance when it takes one, else its fields."""
        if self.takes_config:
            return {"config": config}
        return attrs.asdict(config, recurse=False)


@attrs.frozen
class TierInfo:
    """What the registry knows of one tier kind."""

    name: str
    cls: type
    config_cls: type
    origin: str
    # "objects": host-memory objects kernels gather into and scatter from (memory);
    # "bytes": encoded payloads behind a health guard (disk, redis, most user tiers).
    holds: str = "bytes"


def _config_from_signature(func: Callable[..., Any], where: str) -> type:
    """An attrs class whose fields are the stage's keyword-only settings."""
    sig = inspect.signature(func)
    params = list(sig.parameters.values())
    if not params or params[0].kind not in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    ):
        raise RegistryError(
            f"stage function {func.__qualname__} ({where}) must take the item iterator "
            "as its first positional parameter",
            kind="misuse",
        )
    fields: dict[str, Any] = {}
    for p in params[1:]:
        if p.name == "ctx":
            continue
        if p.kind is not inspect.Parameter.KEYWORD_ONLY:
            raise RegistryError(
                f"stage function {func.__qualname__} ({where}): setting '{p.name}' must be "
                "keyword-only (put it after a bare '*')",
                kind="misuse",
            )
        annotation = p.annotation if p.annotation is not inspect.Parameter.empty else Any
        if isinstance(annotation, str):
            annotation = _eval_annotation(annotation, func)
        if p.default is inspect.Parameter.empty:
            fields[p.name] = attrs.field(type=annotation)
        else:
            fields[p.name] = attrs.field(type=annotation, default=p.default)
    # Required fields first: attrs wants no mandatory field after a defaulted one.
    ordered = dict(sorted(fields.items(), key=lambda kv: kv[1]._default is not attrs.NOTHING))
    return attrs.make_class(f"{func.__name__}_config", ordered, frozen=True, kw_only=True)


def _eval_annotation(text: str, func: Callable[..., Any]) -> Any:
    try:
        return eval(text, dict(vars(inspect.getmodule(func) or object)))  # noqa: S307 - annotations
    except Exception:
        return Any


def stage(
    name: str,
    *,
    kinds: Iterable[str] = ("store", "retrieve"),
    needs: Iterable[str] = (),
    gives: Iterable[str] = (),
    config: type | None = None,
    per_layer: bool = False,
    role: Role | str = Role.OTHER,
    accepts_hashes: bool = False,
    lossy: bool | Callable[[Any], bool] = False,
    encodings: Callable[[Any], list[tuple[str, dict[str, Any]]]] | None = None,
    reads: Iterable[str] = (),
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare a generator function as a flowkv stage.

    ``kinds`` lists the pipelines it may appear in (store, retrieve, lookup, and
    a node server's ``server`` list);
    ``needs`` and ``gives`` are the item facets (`Facet`) it reads and adds; ``config``
    is an attrs class of its settings (the function then takes ``config``, the
    instance), else its keyword-only parameters are.
    ``per_layer`` stages run once per attention layer in layerwise pipelines
    (``ctx.layer`` says which); the stages before and after them run once.

    What the stage is, for the parts of flowkv that must know (`StageInfo`):
    ``role`` (`Role`), ``accepts_hashes`` (a chunker or keyer precomputed
    chunk hashes may stand in for), ``lossy`` (a bool, or a callable of the
    config: the [quality] gate holds such a stage to a record) and, for a
    codec, ``encodings`` (its config to ``[(codec, params)]``).
    ``reads`` names top-level tables of the pipeline file the stage takes
    settings from (``"blend"``: ``ctx.services.blend``); the loader refuses a
    pipeline that uses the stage without them.
    """

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        where = _where(func)
        if not inspect.isgeneratorfunction(func):
            raise RegistryError(
                f"stage '{name}': {func.__qualname__} ({where}) must be a generator function "
                "(it yields items)",
                kind="misuse",
            )
        for names, allowed, what in ((kinds, PIPELINE_KINDS, "kinds= names unknown pipeline kind(s)"),
                                     (reads, READABLE_TABLES, "reads= names unknown table(s)")):
            bad = set(names) - set(allowed)
            if bad:
                raise RegistryError(f"stage '{name}' ({where}): {what} {sorted(bad)}; use {list(allowed)}",
                                    kind="misuse")
        if config is not None and not attrs.has(config):
            raise RegistryError(
                f"stage '{name}' ({where}): config= must be an attrs class", kind="misuse"
            )
        params = inspect.signature(func).parameters
        takes_config = "config" in params
        if takes_config and (config is None or params["config"].kind is not inspect.Parameter.KEYWORD_ONLY):
            raise RegistryError(
                f"stage '{name}' ({where}): a 'config' parameter takes the instance of config=: declare "
                "config=AttrsClass and make 'config' keyword-only", kind="misuse"
            )
        try:
            declared_role = Role(role)
        except ValueError:
            raise RegistryError(
                f"stage '{name}' ({where}): unknown role '{role}'{did_you_mean(str(role), [r.value for r in Role])}; "
                f"roles are {[r.value for r in Role]}",
                kind="misuse",
            ) from None
        info = StageInfo(
            name=name,
            func=func,
            kinds=frozenset(kinds),
            needs=_facets(needs, where, name),
            gives=_facets(gives, where, name),
            config_cls=config or _config_from_signature(func, where),
            takes_ctx="ctx" in params,
            origin=f"{func.__module__}.{func.__qualname__} ({where})",
            per_layer=per_layer,
            role=declared_role,
            accepts_hashes=accepts_hashes,
            lossy=lossy,
            encodings=encodings,
            takes_config=takes_config,
            reads=frozenset(reads),
        )
        func.__flowkv_stage__ = info  # type: ignore[attr-defined]
        return func

    return decorate


def tier(name: str, *, config: type) -> Callable[[type], type]:
    """Declare a class as a tier kind, built as ``cls(name=..., config=...)``."""

    def decorate(cls: type) -> type:
        where = _where(cls)
        if not attrs.has(config):
            raise RegistryError(
                f"tier '{name}' ({where}): config= must be an attrs class", kind="misuse"
            )
        holds = getattr(cls, "holds", "bytes")
        if holds not in ("bytes", "objects"):
            raise RegistryError(
                f"tier '{name}' ({where}): holds must be 'bytes' or 'objects' (subclass "
                "flowkv.tiers.Tier or flowkv.tiers.ObjectTier)", kind="misuse"
            )
        cls.__flowkv_tier__ = TierInfo(  # type: ignore[attr-defined]
            name=name, cls=cls, config_cls=config, origin=f"{cls.__module__}.{cls.__qualname__} ({where})",
            holds=holds,
        )
        return cls

    return decorate


# -- finding things by name -------------------------------------------------


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    found: dict[str, importlib.metadata.EntryPoint] = {}
    for ep in [*importlib.metadata.entry_points(group=ENTRY_POINT_GROUP),
               *importlib.metadata.entry_points(group=DEPRECATED_ENTRY_POINT_GROUP)]:
        if ep.name in BUILTIN_STAGES or ep.name in BUILTIN_TIERS:
            raise RegistryError(
                f"two stages named '{ep.name}': the built-in one "
                f"({BUILTIN_STAGES.get(ep.name) or BUILTIN_TIERS.get(ep.name)}) and entry point "
                f"'{ep.value}' of distribution {_dist_name(ep)}",
                kind="duplicate",
            )
        if ep.name in found and found[ep.name].value != ep.value:
            raise RegistryError(
                f"two stages named '{ep.name}': entry point '{found[ep.name].value}' of "
                f"{_dist_name(found[ep.name])} and '{ep.value}' of {_dist_name(ep)}",
                kind="duplicate",
            )
        found[ep.name] = ep
    return found


def _dist_name(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"'{dist.name}'" if dist is not None else "(unknown distribution)"


def _import_target(target: str, name: str) -> Any:
    """Import ``"pkg.module:attr"``; a missing module and a missing attribute read differently."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise RegistryError(
            f"'{target}' is not of the form 'pkg.module:name'", kind="unknown"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        raise RegistryError(
            f"'{name}': module '{missing}' is not installed (needed for '{target}'); "
            f"install the package that provides it, e.g. `pip install {missing.split('.')[0]}`",
            kind="module-not-found",
        ) from exc
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        raise RegistryError(
            f"'{name}': module '{module_name}' ({getattr(module, '__file__', '?')}) has no "
            f"attribute '{attr}'",
            kind="attribute-not-found",
        ) from exc


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def resolve_stage(name: str) -> StageInfo:
    """The stage a pipeline file names by ``use = "..."``."""
    return _resolve(name, BUILTIN_STAGES, what="stage", decorator="stage")


def resolve_tier(name: str) -> TierInfo:
    """The tier kind a pipeline file names by ``kind = "..."``."""
    return _resolve(name, BUILTIN_TIERS, what="tier kind", decorator="tier")


def _resolve(name: str, builtins: dict[str, str], *, what: str, decorator: str) -> Any:
    """The info that ``@flowkv.<decorator>`` left on what ``name`` names."""
    if ":" in name:
        obj = _import_target(name, name)
    elif name in builtins:
        obj = _import_target(builtins[name], name)
    else:
        entry_points = _entry_points()
        if name not in entry_points:
            known = list(builtins) + list(entry_points)
            raise RegistryError(f"unknown {what} '{name}'{did_you_mean(name, known)}", kind="unknown")
        ep = entry_points[name]
        if ep.group == DEPRECATED_ENTRY_POINT_GROUP:
            warnings.warn(
                f"'{name}' comes from the entry-point group '{DEPRECATED_ENTRY_POINT_GROUP}' of distribution "
                f"{_dist_name(ep)}; register it under '{ENTRY_POINT_GROUP}' (the old group will go away)",
                DeprecationWarning, stacklevel=3,
            )
        obj = _import_target(ep.value, name)
    info = getattr(obj, f"__flowkv_{decorator}__", None)
    if info is None:
        raise RegistryError(
            f"'{name}' names {obj!r}, which is not declared with @flowkv.{decorator}", kind="misuse"
        )
    return info


def builtin_role(name: str) -> Role | None:
    """The role a built-in stage declares (None for any other name): for traces written before
    stage spans carried ``flowkv.stage.role``. Never imports what a trace file names."""
    if name not in BUILTIN_STAGES:
        return None
    return resolve_stage(name).role


def available() -> dict[str, list[tuple[str, str]]]:
    """Names known without importing anything: {"stages": [(name, target)], "tiers": [...],
    "installed": [(name, "dist: target")]}."""
    installed = [(n, f"{_dist_name(ep)}: {ep.value}") for n, ep in sorted(_entry_points().items())]
    return {
        "stages": sorted(BUILTIN_STAGES.items()),
        "tiers": sorted(BUILTIN_TIERS.items()),
        "installed": installed,
    }
