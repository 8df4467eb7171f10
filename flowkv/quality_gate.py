"""The ``[quality]`` gate: may a pipeline with lossy codecs load, given its quality record?

Pure checks on a loaded pipeline and a JSON record, nothing that runs a
model: the pipeline loader calls ``check_gate`` (a failure is a diagnostic at
``[quality] min_agreement``), the vLLM connector calls ``check_served_model``
at start. The measurement that writes the record, ``flowkv quality``, is
``flowkv.quality``; its docstring describes the record and the settings.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flowkv.codecs import codec_names, get_codec
from flowkv.registry import Facet, Role

__all__ = [
    "RECORD_FORMAT",
    "canonical_params",
    "check_gate",
    "codec_code_digest",
    "check_served_model",
    "codec_settings",
    "describe_codec",
    "blend_setting",
    "gate_warnings",
    "load_record",
    "model_digest",
    "record_path",
]

#: Version of the quality record's JSON layout.
RECORD_FORMAT = 1


# -- the codecs a pipeline uses ---------------------------------------------------


def canonical_params(codec: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """Every parameter of `codec`, defaults filled in, as the payload header stores them."""
    impl = get_codec(codec)
    return impl.params_to_header(impl.resolve_params(**dict(params)))


def codec_settings(store_stages: Sequence[Any]) -> list[tuple[str, dict[str, Any]]]:
    """(codec, full parameters) of each codec stage of a store list, in order, without repeats.

    `store_stages` are the loader's ``StageSpec``s; a stage is a codec by its
    declared role (`flowkv.registry.Role.CODEC`, encoding: it gives ``payload``).
    """
    return _encodings([s for s in store_stages if s.info.role is Role.CODEC and Facet.PAYLOAD in s.info.gives])


def _lossy_codecs(store_stages: Sequence[Any]) -> list[tuple[str, dict[str, Any]]]:
    """The encodings of the store list's lossy stages (their declared ``lossy``, whatever their
    role or name): what the gate holds to a record. A flowkv codec that is lossless stays out even
    there (a measurement stage may mix both)."""
    found = _encodings([s for s in store_stages if s.info.is_lossy(s.config)])
    return [(c, p) for c, p in found if not (_flowkv_codec(c) and get_codec(c).lossless)]


def _encodings(specs: Sequence[Any]) -> list[tuple[str, dict[str, Any]]]:
    """What each stage writes as records name it (`StageInfo.encodings_of`), without repeats.

    A flowkv codec's parameters get their defaults filled in; a third-party
    stage's stays as it names it (by default its own name and its settings).
    """
    found: list[tuple[str, dict[str, Any]]] = []
    for spec in specs:
        for codec, params in spec.info.encodings_of(spec.config):
            entry = (codec, canonical_params(codec, params) if _flowkv_codec(codec) else dict(params))
            if entry not in found:
                found.append(entry)
    return found


def blend_setting(blend: Any) -> tuple[str, dict[str, Any]] | None:
    """A ``[blend]`` table as a record names what it measured: ``("blend", {"check_layers": [1],
    "recompute_ratio": 0.15})``; None for a pipeline that does not blend.

    CacheBlend's output is approximate, as a lossy codec's is: the gate holds it to a record the same
    way. The separator is not part of it (it chooses what is reused, not how).
    """
    if blend is None:
        return None
    return "blend", {"check_layers": list(blend.check_layers), "recompute_ratio": float(blend.recompute_ratio)}


def _gated(store_stages: Sequence[Any], blend: Any) -> list[tuple[str, dict[str, Any]]]:
    """What a record must measure: the store list's lossy codecs, then the blend (if any)."""
    gated = _lossy_codecs(store_stages)
    if (setting := blend_setting(blend)) is not None:
        gated.append(setting)
    return gated


def _flowkv_codec(name: str) -> bool:
    return name in codec_names()


def describe_codec(codec: str, params: Mapping[str, Any]) -> str:
    """``int8 {"group_size": 32}``: a codec and its parameters as messages name them."""
    return codec + ("" if not params else " " + json.dumps(dict(params), sort_keys=True))


def codec_code_digest(codec: str) -> str:
    """sha256 of the code that encodes and decodes with flowkv codec `codec`: its class and its bases' source and
    every module-level function of theirs they name (transitively).

    A record's agreement holds for the code that was measured: a change to how a codec quantizes
    moves the digest, and the gate then asks for a new measurement. Edits elsewhere (another codec,
    a comment in an unrelated function) leave it. A lossy codec's digest covers what it is handed
    too (`_lossy_input_code`).
    """
    impl = type(get_codec(codec))
    parts: list[str] = []
    seen: set[str] = set()
    pending = [cls for cls in impl.__mro__ if cls.__module__ == impl.__module__ or cls is impl]
    while pending:
        obj = pending.pop(0)
        name = f"{obj.__module__}.{obj.__qualname__}"
        if name in seen:
            continue
        seen.add(name)
        try:
            source = inspect.getsource(obj)
        except (OSError, TypeError):  # defined where no source is (a REPL): its name stands in
            source = name
        parts.append(source)
        module = inspect.getmodule(obj)
        for word in sorted(set(re.findall(r"\b_?[A-Za-z]\w*", source))):
            used = getattr(module, word, None)
            if (inspect.isfunction(used) or inspect.isclass(used)) and getattr(used, "__module__", None) == obj.__module__:
                pending.append(used)
    if not impl.lossless:
        parts.extend(_lossy_input_code())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _lossy_input_code() -> list[str]:
    """The source of what decides which values a lossy codec quantizes: on vLLM's packed CPU cache,
    a chunk's true tokens, unpacked and packed back through the engine's table. A change there
    changes what a record measured as much as a change in the codec does."""
    from flowkv import payload
    from flowkv.kernels import packed_cpu

    layout = packed_cpu.PackedBlockLayout
    return [inspect.getsource(obj) for obj in (payload._codec_input, payload._packed, layout.whole_blocks,
                                               layout.unpack_chunk, layout.pack_chunk, layout.unpack, layout.pack,
                                               packed_cpu._chunk_regions)]


# -- the record and the gate ----------------------------------------------------


def model_digest(model: Path) -> str:
    """sha256 of the model's config.json: tells records of different models apart."""
    return hashlib.sha256((model / "config.json").read_bytes()).hexdigest()


def load_record(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a quality record; ValueError saying what is wrong with it."""
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read quality record {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"quality record {path} is not JSON: {exc}") from None
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT or not isinstance(record.get("codecs"), list):
        raise ValueError(f"{path} is not a flowkv quality record (format {RECORD_FORMAT}, with a 'codecs' list)")
    for entry in record["codecs"]:
        if not (isinstance(entry, dict) and isinstance(entry.get("codec"), str)
                and isinstance(entry.get("params"), dict) and isinstance(entry.get("agreement"), (int, float))):
            raise ValueError(f"quality record {path}: a codecs entry lacks codec, params or agreement: {entry!r}")
    return record


def record_path(record: str, source: str) -> Path:
    """Where a ``[quality] record`` of the pipeline loaded from `source` is.

    ``~`` is expanded; a relative path is taken from the pipeline file's
    folder, or from the working directory for a pipeline loaded from a
    string (`source` ``"<string>"``).
    """
    path = Path(record).expanduser()
    if not path.is_absolute():
        path = (Path(source).parent if source != "<string>" else Path.cwd()) / path
    return path


def check_gate(
    store_stages: Sequence[Any],
    *,
    min_agreement: float,
    record: str | None,
    source: str,
    blend: Any = None,
) -> list[str]:
    """Why a pipeline with these store stages fails ``[quality] min_agreement``; empty when it passes.

    Only lossy codecs and a ``[blend]`` table (`blend`, the pipeline's
    ``BlendSpec`` or None) are gated. `source` is the pipeline file (or
    ``"<string>"``): `record` is found as ``record_path`` says.
    """
    if not 0.0 <= min_agreement <= 1.0:
        return [f"[quality] min_agreement must be between 0 and 1, got {min_agreement}"]
    try:
        lossy = _gated(store_stages, blend)
    except ValueError as exc:  # an unknown codec or parameter: nothing to look up in a record
        return [f"[quality] cannot gate this pipeline's codecs: {exc}"]
    if not lossy:
        return []
    names = ", ".join(describe_codec(c, p) for c, p in lossy)
    if record is None:
        return [f"[quality] no quality record exists for this model of lossy setting(s) {names}: "
                f"min_agreement needs one; set record = \"PATH\" to a record written by "
                f"'flowkv quality PIPELINE --model MODEL --out PATH'"]
    path = record_path(record, source)
    if not path.exists():
        return [f"[quality] no quality record at {path} for lossy setting(s) {names}: "
                f"write it with 'flowkv quality PIPELINE --out {path}'"]
    try:
        data = load_record(path)
    except ValueError as exc:
        return [f"[quality] {exc}"]
    measured = {(e["codec"], json.dumps(e["params"], sort_keys=True)): e for e in data["codecs"]}
    problems = []
    for codec, params in lossy:
        entry = measured.get((codec, json.dumps(params, sort_keys=True)))
        if entry is None:
            have = ", ".join(describe_codec(e["codec"], e["params"]) for e in data["codecs"]) or "nothing"
            problems.append(f"[quality] record {path} has no measurement of {describe_codec(codec, params)} "
                            f"(it measured: {have}); run 'flowkv quality' on this pipeline again")
        elif _flowkv_codec(codec) and entry.get("code_sha256") not in (None, codec_code_digest(codec)):
            problems.append(f"[quality] record {path} measured another version of {codec}'s code (its "
                            f"code_sha256 differs from this flowkv's): run 'flowkv quality' on this pipeline again")
        elif entry["agreement"] < min_agreement:
            problems.append(
                f"[quality] {describe_codec(codec, params)} agreed with the uncompressed model on "
                f"{entry['agreement']:.1%} of greedy tokens (record {path}, model {data.get('model', '?')}), "
                f"below min_agreement {min_agreement:.1%}"
            )
    return problems


def check_served_model(pipeline: Any, model: str) -> str | None:
    """Whether the quality record a pipeline is gated by measured ``model``.

    ``ValueError`` when the record measured another model (its config.json
    differs): an agreement measured on one model says nothing of another.
    Returns a warning when the served model cannot be checked (not a local
    folder with a config.json); None when it matches or nothing is gated.
    """
    quality = pipeline.quality
    if quality.min_agreement is None or quality.record is None:
        return None
    if not _gated(pipeline.store, pipeline.blend):
        return None
    path = record_path(quality.record, pipeline.source)
    record = load_record(path)
    config = Path(model).expanduser() / "config.json"
    if not config.is_file():
        return (f"[quality] cannot check that record {path} measured the served model {model!r} "
                f"(no local config.json); make sure it did")
    if record.get("model_config_sha256") != model_digest(config.parent):
        raise ValueError(
            f"[quality] record {path} measured model {record.get('model', '?')}, but vLLM serves {model} (config.json differs): "
            f"its agreement does not hold for this model; run 'flowkv quality PIPELINE --model {model} --out {path}'"
        )
    return None



def gate_warnings(pipeline: Any, model: str) -> list[str]:
    """What vLLM logs at start about a pipeline's ``[quality]`` gate, serving `model`.

    In ``mode = "enforce"`` the loader already refused a failing gate, so
    only ``check_served_model``'s warning (or its ``ValueError``) remains.
    In ``mode = "warn"`` every refusal is a warning instead, a record of
    another model included: the pipeline loads, unmeasured or measured low.
    """
    quality = pipeline.quality
    if quality.mode != "warn" or quality.min_agreement is None:
        warning = check_served_model(pipeline, model)
        return [] if warning is None else [warning]
    problems = check_gate(pipeline.store, min_agreement=quality.min_agreement, record=quality.record,
                          source=pipeline.source, blend=pipeline.blend)
    if not problems:
        try:
            warning = check_served_model(pipeline, model)
        except ValueError as exc:
            warning = str(exc)
        problems = [] if warning is None else [warning]
    return [f"{p} (the [quality] gate is in warn mode; set mode = \"enforce\" to refuse instead)" for p in problems]
