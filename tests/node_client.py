"""A client process of a node server for the tests: one engine, one call, its result as JSON on stdout.

    python tests/node_client.py PIPELINE store --seed 1 --tokens 160 [--tags k=v,...]
    python tests/node_client.py PIPELINE retrieve --seed 1 --tokens 160     # also prints whether the KV matches
    python tests/node_client.py PIPELINE lookup --tokens 160 [--pin ID] [--then-wait FILE]

``--seed`` fills the paged KV the store reads (``node_servers.kv_for``), so a
retrieving process can check what it loaded against the same seed.
``--then-wait FILE`` keeps the process (and what it holds) alive until FILE
exists, or until it is killed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's flowkv, not an installed one

from node_servers import chunk_kv, geometry, kv_for, slots_for  # noqa: E402

from flowkv import CacheEngine, KVTransfer  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("pipeline")
    parser.add_argument("action", choices=("store", "retrieve", "lookup"))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--first-token", type=int, default=0)
    parser.add_argument("--tags", default="")
    parser.add_argument("--model", default="m")
    parser.add_argument("--pin")
    parser.add_argument("--then-wait")
    args = parser.parse_args()
    tags = dict(part.split("=", 1) for part in args.tags.split(",") if part)
    engine = CacheEngine.from_pipeline(args.pipeline, geometry=geometry(), model_name=args.model)
    tokens = torch.arange(args.first_token, args.first_token + args.tokens)
    slots = slots_for(args.tokens)
    out: dict[str, object] = {}
    if args.action == "store":
        out["stored"] = engine.store(KVTransfer(tokens=tokens, kv_caches=kv_for(args.seed), slot_mapping=slots,
                                                tags=tags)).stored_tokens
    elif args.action == "lookup":
        out["hit"] = engine.lookup(tokens, tags=tags, pin=args.pin is not None, lookup_id=args.pin)
    else:
        dst = kv_for(1000 + args.seed)
        mask = engine.retrieve(KVTransfer(tokens=tokens, kv_caches=dst, slot_mapping=slots, tags=tags)).ret_mask
        loaded = int(mask.sum())
        out["loaded"] = loaded
        out["same_kv"] = bool(torch.equal(chunk_kv(dst, slots[:loaded]), chunk_kv(kv_for(args.seed), slots[:loaded])))
    out["tier"] = engine.stats()["tiers"]["node"]
    print(json.dumps(out), flush=True)
    if args.then_wait:
        while not Path(args.then_wait).exists():
            time.sleep(0.01)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
