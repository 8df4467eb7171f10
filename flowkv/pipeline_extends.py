"""Pipeline files on top of others: ``extends``, what a child changes, and where each setting came from.

A file that says ``extends = "local-cpu"`` (a built-in name, or a path
relative to the file) holds only what differs from that parent::

    extends = "local-cpu"

    [pipeline]
    name = "cpu-disk"            # a key replaces the parent's key; the others stay

    [tiers.disk]                 # a new tier comes after the parent's, in the child's order
    kind = "disk"
    path = "~/.cache/flowkv/disk"

    [tiers.memory]
    capacity = "8GiB"            # a tier the parent has: its keys are merged (a new kind replaces it)
    # drop = true                # ... or it is removed

    [store]
    replace = ["compress"]       # these consecutive stages of the parent's list ...
    [[store.stages]]             # ... give way to the child's stages; without replace, a child's
    use = "compress"             # [[store.stages]] replace the parent's whole list
    codec = "lz4-shuffle"

Every table and key keeps the place it was written, in the file that wrote
it (``Positions``): a mistake in a parent is reported at the parent's
FILE:LINE:COL, and ``flowkv pipeline show`` says which file set each key.
A cycle of ``extends`` is an error.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flowkv._tomlpos import key_positions
from flowkv.pipeline_model import Diagnostic, PipelineError
from flowkv.registry import PIPELINE_KINDS, did_you_mean

__all__ = ["Positions", "read_layers"]

#: A table's or key's path in the raw TOML -> (file, line, column) where it was written.
Positions = dict[tuple[str | int, ...], tuple[str, int, int]]

_LISTS = PIPELINE_KINDS


def read_layers(
    text: str, file: str, *, builtins: Callable[[], dict[str, Path]], problems: list[Diagnostic],
) -> tuple[dict[str, Any], Positions, tuple[str, ...]]:
    """The raw TOML of ``text`` with what it extends merged in, every path's position, and the
    files it extends (nearest first). A problem of the merge is appended to ``problems``; a file
    that cannot be read or parsed raises ``PipelineError`` at once."""
    return _Layer(builtins, problems).read(text, file, ())


class _Layer:
    def __init__(self, builtins: Callable[[], dict[str, Path]], problems: list[Diagnostic]) -> None:
        self.builtins = builtins
        self.problems = problems

    def error(self, positions: Positions, file: str, path: tuple[str | int, ...], message: str, kind: str) -> None:
        where = positions.get(path, (file, 1, 1))
        self.problems.append(Diagnostic(where[0], where[1], where[2], message, kind))

    def read(self, text: str, file: str, chain: tuple[Path, ...]) -> tuple[dict[str, Any], Positions, tuple[str, ...]]:
        raw = parse(text, file)
        positions = {path: (file, line, col) for path, (line, col) in key_positions(text).items()}
        if "extends" not in raw:
            return raw, positions, ()
        target = raw.pop("extends")
        if not isinstance(target, str) or not target:
            self.error(positions, file, ("extends",), "extends must name a pipeline: a built-in name or a "
                       "path relative to this file", "invalid-value")
            return raw, positions, ()
        parent = self.parent_path(target, file)
        if parent is None:
            known = self.builtins()
            self.error(positions, file, ("extends",),
                       f"extends = {target!r}: no built-in pipeline or file of that name{did_you_mean(target, known)} "
                       f"(built-ins: {', '.join(sorted(known))}; a path is taken from this file's folder)",
                       "unknown-pipeline")
            return raw, positions, ()
        here = Path(file).resolve() if file != "<string>" else None
        seen = (*chain, *([here] if here is not None else []))
        if parent.resolve() in seen:
            loop = " -> ".join(str(p) for p in (*seen[seen.index(parent.resolve()):], parent.resolve()))
            self.error(positions, file, ("extends",), f"extends makes a cycle: {loop}", "extends-cycle")
            return raw, positions, ()
        parent_raw, parent_positions, above = self.read(parent.read_text(encoding="utf-8"), str(parent), seen)
        merged, merged_positions = self.merge(parent_raw, parent_positions, str(parent), raw, positions, file)
        return merged, merged_positions, (str(parent), *above)

    def parent_path(self, target: str, file: str) -> Path | None:
        if target.endswith(".toml") or "/" in target:
            base = Path(file).parent if file != "<string>" else Path.cwd()
            path = (base / Path(target).expanduser())
            return path if path.is_file() else None
        return self.builtins().get(target)

    # -- merging a child onto its parent ----------------------------------------------------------

    def merge(self, parent: dict[str, Any], ppos: Positions, pfile: str, child: dict[str, Any], cpos: Positions,
              cfile: str) -> tuple[dict[str, Any], Positions]:
        out: dict[str, Any] = {}
        pos: Positions = {}
        for key in [*parent, *(k for k in child if k not in parent)]:
            if key not in child:
                out[key] = parent[key]
                _carry(pos, ppos, (key,), (key,))
            elif key not in parent or not (isinstance(parent[key], dict) and isinstance(child[key], dict)):
                out[key] = child[key]
                _carry(pos, cpos, (key,), (key,))
            elif key == "tiers":
                out[key] = self.merge_tiers(parent[key], ppos, pfile, child[key], cpos, cfile, pos)
            elif key in _LISTS:
                out[key] = self.merge_list(key, parent[key], ppos, pfile, child[key], cpos, cfile, pos)
            else:
                out[key] = _merge_keys(parent[key], ppos, child[key], cpos, (key,), pos)
        quality = out.get("quality")
        if (isinstance(quality, dict) and isinstance(quality.get("record"), str)
                and "record" not in child.get("quality", {}) and Path(pfile).parent != Path(cfile).parent):
            # A record path is the declaring file's: keep it pointing where the parent meant.
            record = Path(quality["record"]).expanduser()
            if not record.is_absolute():
                out["quality"] = {**quality, "record": str(Path(pfile).parent / record)}
        return out, pos

    def merge_tiers(self, parent: dict[str, Any], ppos: Positions, pfile: str, child: dict[str, Any],
                    cpos: Positions, cfile: str, pos: Positions) -> dict[str, Any]:
        _carry(pos, cpos, ("tiers",), ("tiers",), only_self=True)
        out: dict[str, Any] = {}
        for name in [*parent, *(n for n in child if n not in parent)]:
            path = ("tiers", name)
            mine, theirs = child.get(name), parent.get(name)
            if mine is None:
                out[name] = theirs
                _carry(pos, ppos, path, path)
            elif isinstance(mine, dict) and mine.get("drop") is True:
                if set(mine) != {"drop"}:
                    self.error(cpos, cfile, path, f"[tiers.{name}]: drop = true takes no other key", "invalid-value")
                if theirs is None:
                    self.error(cpos, cfile, path + ("drop",),
                               f"[tiers.{name}]: {pfile} declares no tier '{name}' to drop"
                               f"{did_you_mean(name, parent)}", "unknown-tier")
            elif (isinstance(mine, dict) and isinstance(theirs, dict)
                  and mine.get("kind", theirs.get("kind")) == theirs.get("kind")):
                out[name] = _merge_keys(theirs, ppos, mine, cpos, path, pos)
            else:  # a new tier, or another kind under the same name: the child's table alone
                out[name] = mine
                _carry(pos, cpos, path, path)
        return out

    def merge_list(self, kind: str, parent: dict[str, Any], ppos: Positions, pfile: str, child: dict[str, Any],
                   cpos: Positions, cfile: str, pos: Positions) -> dict[str, Any]:
        if "replace" not in child:
            _carry(pos, cpos, (kind,), (kind,))
            return child
        names = child["replace"]
        names = [names] if isinstance(names, str) else names
        section = {k: v for k, v in child.items() if k != "replace"}
        theirs, mine = parent.get("stages"), section.get("stages", [])
        if not (isinstance(names, list) and names and all(isinstance(n, str) for n in names)):
            self.error(cpos, cfile, (kind, "replace"), f"[{kind}] replace must name consecutive stages of the "
                       f"parent's list, e.g. replace = [\"compress\"]", "invalid-value")
            _carry(pos, ppos, (kind,), (kind,))
            return parent
        if not isinstance(theirs, list) or not isinstance(mine, list):
            _carry(pos, cpos, (kind,), (kind,))
            return section
        uses = [table.get("use") if isinstance(table, dict) else None for table in theirs]
        start = next((i for i in range(len(uses) - len(names) + 1) if uses[i:i + len(names)] == names), None)
        if start is None:
            hint = "".join(did_you_mean(n, [u for u in uses if isinstance(u, str)]) for n in names if n not in uses)
            self.error(cpos, cfile, (kind, "replace"),
                       f"[{kind}] replace = {names}: the [[{kind}.stages]] of {pfile} have no such consecutive "
                       f"stages (they are: {', '.join(map(str, uses))}){hint}", "unknown-stage")
            # Nothing to splice into: the parent's list stands, and only the replace is reported.
            _carry(pos, ppos, (kind,), (kind,))
            return parent
        stages = [*theirs[:start], *mine, *theirs[start + len(names):]]
        _carry(pos, cpos, (kind,), (kind,), only_self=True)
        _carry(pos, cpos if (kind, "stages") in cpos else ppos, (kind, "stages"), (kind, "stages"), only_self=True)
        for index in range(start):
            _carry(pos, ppos, (kind, "stages", index), (kind, "stages", index))
        for index in range(len(mine)):
            _carry(pos, cpos, (kind, "stages", index), (kind, "stages", start + index))
        for index in range(start + len(names), len(theirs)):
            _carry(pos, ppos, (kind, "stages", index), (kind, "stages", index - len(names) + len(mine)))
        return {**section, "stages": stages}


def _merge_keys(parent: dict[str, Any], ppos: Positions, child: dict[str, Any], cpos: Positions,
                path: tuple[str | int, ...], pos: Positions) -> dict[str, Any]:
    """One table: the child's keys over the parent's, each key placed where it was written."""
    _carry(pos, ppos, path, path)
    _carry(pos, cpos, path, path, only_self=True)
    for key in child:
        for stale in [p for p in pos if p[:len(path) + 1] == (*path, key)]:
            del pos[stale]
        _carry(pos, cpos, (*path, key), (*path, key))
    return {**parent, **child}


def _carry(pos: Positions, source: Positions, old: tuple[str | int, ...], new: tuple[str | int, ...], *,
           only_self: bool = False) -> None:
    """Copy the positions of ``old`` (and, unless ``only_self``, of everything under it) to ``new``."""
    for path, where in source.items():
        if path == old or (not only_self and path[:len(old)] == old):
            pos[new + path[len(old):]] = where


def parse(text: str, file: str) -> dict[str, Any]:
    """The TOML of one file; a syntax error is a ``PipelineError`` at its FILE:LINE:COL."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        line, col = _syntax_position(exc)
        message = re.sub(r"\s*\(at line \d+, column \d+\)", "", str(exc))
        raise PipelineError([Diagnostic(file, line, col, f"TOML syntax: {message}", "syntax")]) from None


def _syntax_position(exc: tomllib.TOMLDecodeError) -> tuple[int, int]:
    line = getattr(exc, "lineno", None)
    col = getattr(exc, "colno", None)
    if line is None:
        match = re.search(r"at line (\d+), column (\d+)", str(exc))
        if match:
            line, col = int(match.group(1)), int(match.group(2))
    return (line or 1, col or 1)
