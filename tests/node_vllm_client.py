"""A vLLM process of its own for ``test_vllm_node.py``: serve some requests through a node server, write
what came out, then (with ``--hold``) start one more request whose store holds in the worker until
the process is killed.

    python tests/node_vllm_client.py --pipeline P.toml --requests R.json --out O.json [--hold DIR]

``R.json``: ``[{"name": ..., "tokens": [...], "tags": {...}}, ...]``; ``O.json``:
``{name: {"output": [...], "cached": n}}``, written once every request is done.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's flowkv, not an installed one

from node_servers import HOLD_TAG  # noqa: E402
from vllm_helpers import generate, make_llm, random_tokens, request  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pipeline", required=True)
    parser.add_argument("--requests", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--hold")
    args = parser.parse_args()
    llm = make_llm({"pipeline": args.pipeline})
    results = {}
    for spec in json.loads(Path(args.requests).read_text(encoding="utf-8")):
        [(output, cached)] = generate(llm, [request(spec["tokens"], tags=spec.get("tags"))])
        results[spec["name"]] = {"output": output, "cached": cached}
    tmp = Path(args.out + ".tmp")
    tmp.write_text(json.dumps(results), encoding="utf-8")
    os.replace(tmp, args.out)
    if args.hold:
        # Its store holds after gathering its first chunk (node_servers.hold): killed there.
        generate(llm, [request(random_tokens(4242, 1100), tags={HOLD_TAG: args.hold})])
    return 0


if __name__ == "__main__":
    sys.exit(main())
