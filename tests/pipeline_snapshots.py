"""The effective pipeline of a file, as `flowkv pipeline show --json` gives it, without where things are.

Locations (the file, FILE:LINE:COL of each table, the stage function's own
file:line) move when files are rearranged; what a pipeline does is the rest.
``tests/fixtures/effective/NAME.json`` holds each built-in pipeline's, taken
from the files before they used ``extends`` (the node pipelines' socket since
then a user's private default, named by a placeholder).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SNAPSHOTS = Path(__file__).resolve().parent / "fixtures" / "effective"
_WHERE = ("source", "at", "stage", "implementation", "from", "extends")


def effective(pipeline: Any) -> dict[str, Any]:
    from flowkv.cli import describe

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in _WHERE}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    # The tier order is the lookup order: kept as a list (a JSON object's keys are not compared in order).
    return {**strip(describe(pipeline)), "tier_order": list(pipeline.tiers)}


def write_snapshot(name: str, pipeline: Any) -> None:
    (SNAPSHOTS / f"{name}.json").write_text(json.dumps(effective(pipeline), indent=2, sort_keys=True) + "\n")


# The node pipelines' socket is each user's private default (issue 25), not a fixed path: the
# snapshots name it by this placeholder.
DEFAULT_SOCKET = "<the private default socket>"


def read_snapshot(name: str) -> dict[str, Any]:
    from flowkv.tiers.node_protocol import default_socket_path

    text = (SNAPSHOTS / f"{name}.json").read_text()
    return json.loads(text.replace(json.dumps(DEFAULT_SOCKET), json.dumps(str(default_socket_path()))))
