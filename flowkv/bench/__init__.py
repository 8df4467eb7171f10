"""``flowkv bench NAME``: one module per benchmark, imported only when run.

Each module has ``add_arguments(parser)`` and ``run(args) -> int``. Every
benchmark measures a baseline in the same run and prints ratios against it.
"""

BENCHMARKS: dict[str, tuple[str, str]] = {
    "runner": ("flowkv.bench.runner", "runner overhead per item and stage, against a hand loop"),
    "engine": ("flowkv.bench.engine", "store/retrieve throughput against a plain copy; hashing; lookup"),
    "tiers": ("flowkv.bench.tiers", "put/get throughput per tier against raw copy, file and redis-py"),
    "codecs": ("flowkv.bench.codecs", "compression ratio, speed and error per codec"),
    "capacity": ("flowkv.bench.capacity", "documents a fixed disk holds and warm TTFT from disk: raw, lossless, lossy"),
    "ttft": ("flowkv.bench.ttft", "vLLM time to first token: no cache, flowkv, ExampleConnector"),
}
