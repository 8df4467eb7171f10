"""``flowkv bench route``: round-robin against ``flowkv route`` in front of two vLLM servers.

One run starts a ``flowkv controller``, two ``vllm serve`` processes with
flowkv (pipeline ``local-cpu``, each memory tier sized to hold about half of
the documents, vLLM's own prefix cache off so every hit is flowkv's) and two
``flowkv route`` proxies in front of them: one round-robin, one by cached
prefix. The same workload goes through each in turn, from cold caches (the
controller clears both instances between the two): ``--documents`` documents,
each asked ``--repeats`` times with a question after it, in one shuffled
order, ``--concurrency`` requests at a time. Printed side by side: hit rate
(prompt tokens served from flowkv), TTFT p50 / p99 (time to the first
streamed token), requests per second.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "run"]

MODEL_NAME = "demo"
_BLOCK = 128


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``flowkv bench route``."""
    from flowkv.bench.serve import EAGER_HELP
    from flowkv.integration.harness import default_model_dir

    parser.add_argument("--documents", type=int, default=8, help="distinct documents (default 8)")
    parser.add_argument("--doc-tokens", type=int, default=2048, help="tokens per document (default 2048)")
    parser.add_argument("--repeats", type=int, default=3, help="times each document is asked (default 3)")
    parser.add_argument("--concurrency", type=int, default=2, help="requests in flight (default 2)")
    parser.add_argument("--memory-docs", type=float, default=5.0,
                        help="documents each instance's memory tier holds (default 5: a bit over half)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="write a plot of the two modes side by side")
    parser.add_argument("--model-dir", default=str(default_model_dir()),
                        help="the model folder (default: the demo model, built there if missing)")
    parser.add_argument("--keep", action="store_true", help="keep the logs folder")
    parser.add_argument("--eager", action="store_true", help=EAGER_HELP)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _get(url: str, timeout: float = 30, token: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as reply:
        return json.load(reply)


def _post(url: str, body: dict[str, Any], timeout: float = 120, token: str | None = None) -> Any:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.load(reply)


def _token_files(folder: Path) -> dict[str, tuple[str, Path]]:
    """A token per controller role, each in a 0600 file of its own: (token, file)."""
    tokens = {}
    for role in ("instance", "reader", "operator"):
        token, path = secrets.token_urlsafe(24), folder / f"{role}.token"
        path.touch(mode=0o600)
        path.write_text(token + "\n")
        tokens[role] = (token, path)
    return tokens


def _wait(condition, what: str, timeout_s: float = 900.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"timed out waiting until {what}")


class _Processes:
    """The processes of a run; each in a session of its own, all stopped at the end."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, command: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.folder / f"{name}.log", "wb")
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
        self.procs.append(proc)
        return proc

    def log_tail(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _vllm(procs: _Processes, name: str, model: Path, controller: str, token_file: Path, memory_bytes: int,
          kv_cache_bytes: int, max_model_len: int, cores: str, eager: bool) -> str:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    extra = {"pipeline": "local-cpu", "tiers.memory.capacity": memory_bytes,
             "controller": {"url": controller, "instance_id": name, "advertise_url": url, "heartbeat_s": 1.0,
                            "token_file": str(token_file)}}
    config = {"kv_connector": "FlowKVConnector", "kv_connector_module_path": "flowkv.integration.vllm",
              "kv_role": "kv_both", "kv_connector_extra_config": extra}
    command = [str(Path(sys.executable).parent / "vllm"), "serve", str(model), "--served-model-name", MODEL_NAME,
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--block-size", str(_BLOCK),
               "--max-model-len", str(max_model_len), "--no-enable-prefix-caching", "--seed", "0",
               "--kv-cache-memory-bytes", str(kv_cache_bytes), "--enable-prompt-tokens-details",
               "--kv-transfer-config", json.dumps(config), *(["--enforce-eager"] if eager else [])]
    # Each instance on cores of its own, as two instances on one machine would be deployed.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "WARNING",
           "VLLM_CPU_OMP_THREADS_BIND": cores}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    procs.start(name, command, env)
    return url


def _cores(index: int, instances: int) -> str:
    """The cores of instance ``index`` of ``instances``: an equal share of this machine's (shared when fewer)."""
    cores = os.cpu_count() or 1
    share = max(1, cores // instances)
    first = (index * share) % cores
    return str(first) if share == 1 else f"{first}-{first + share - 1}"


def _route(procs: _Processes, name: str, backends: list[str], controller: str, token_file: Path,
           policy: str) -> str:
    port = _free_port()
    command = [str(Path(sys.executable).parent / "flowkv"), "route", "--port", str(port), "--policy", policy,
               "--controller", controller, "--token-file", str(token_file), "--log-level", "warning"]
    for backend in backends:
        command += ["--backend", backend]
    procs.start(name, command)
    url = f"http://127.0.0.1:{port}"
    _wait(lambda: _get(url + "/health")["status"] == "ok", f"{name} answers")
    return url


def _ask(url: str, prompt: list[int]) -> dict[str, Any]:
    """One streamed completion: TTFT, prompt and cached tokens, the backend that served it."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    started = time.perf_counter()
    ttft = None
    usage = None
    with urllib.request.urlopen(request, timeout=900) as reply:
        backend = reply.headers.get("x-flowkv-backend", "")
        for raw in reply:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if ttft is None and any(choice.get("text") for choice in event.get("choices", [])):
                ttft = time.perf_counter() - started
            usage = event.get("usage") or usage
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"ttft_s": ttft if ttft is not None else time.perf_counter() - started,
            "prompt_tokens": usage.get("prompt_tokens", len(prompt)), "cached_tokens": cached, "backend": backend}


def _workload(url: str, prompts: list[list[int]], order: list[int], concurrency: int) -> dict[str, Any]:
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(lambda n: _ask(url, prompts[n]) | {"document": n}, order))
    elapsed = time.perf_counter() - started
    ttfts = sorted(a["ttft_s"] for a in answers)
    prompt_tokens = sum(a["prompt_tokens"] for a in answers)
    cached = sum(a["cached_tokens"] for a in answers)
    homes = {}
    for answer in answers:
        homes.setdefault(answer["document"], set()).add(answer["backend"])
    return {
        "requests": len(answers),
        "hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
        "ttft_p50_ms": statistics.median(ttfts) * 1e3,
        "ttft_p99_ms": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] * 1e3,
        "requests_per_s": len(answers) / elapsed,
        "backends_per_document": statistics.mean(len(v) for v in homes.values()),
        "ttfts_ms": [a["ttft_s"] * 1e3 for a in answers],
    }


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from flowkv.integration.harness import QUESTIONS, documents, kv_bytes_per_token, model_folder

    os.environ["HF_HUB_OFFLINE"] = "1"
    model = model_folder(args.model_dir)  # a model of the user's, else the demo model, built there
    tokenizer = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    docs = documents(tokenizer, args.documents, args.doc_tokens)
    question = tokenizer.encode(QUESTIONS[0], add_special_tokens=False)
    prompts = [doc + question for doc in docs]
    order = [n for n in range(len(docs)) for _ in range(args.repeats)]
    random.Random(args.seed).shuffle(order)
    per_token = kv_bytes_per_token(model)
    memory_bytes = int(args.memory_docs * args.doc_tokens * per_token) + (1 << 20)
    max_model_len = args.doc_tokens + len(question) + 64
    kv_cache_bytes = 4 * (max_model_len + _BLOCK) * per_token * max(1, args.concurrency)

    folder = Path(tempfile.mkdtemp(prefix="flowkv-bench-route-"))
    procs = _Processes(folder)
    results: dict[str, Any] = {}
    try:
        controller_port = _free_port()
        tokens = _token_files(folder)
        procs.start("controller", [str(Path(sys.executable).parent / "flowkv"), "controller", "--port",
                                   str(controller_port), "--heartbeat-s", "1", "--timeout-s", "30",
                                   *[arg for role, (_, path) in tokens.items()
                                     for arg in (f"--{role}-token-file", str(path))],
                                   "--log-level", "warning"])
        controller = f"http://127.0.0.1:{controller_port}"
        _wait(lambda: _get(controller + "/health")["status"] == "ok", "the controller answers")
        print(f"starting two vLLM servers ({args.documents} documents x {args.doc_tokens} tokens, "
              f"memory tier {memory_bytes >> 20} MiB each)...", file=sys.stderr)
        backends = [_vllm(procs, name, model, controller, tokens["instance"][1], memory_bytes, kv_cache_bytes, max_model_len,
                          _cores(index, 2), args.eager) for index, name in enumerate(("vllm-0", "vllm-1"))]
        for name, url in zip(("vllm-0", "vllm-1"), backends):
            _wait(lambda url=url: urllib.request.urlopen(url + "/health", timeout=5).status == 200,
                  f"{name} is ready ({folder / (name + '.log')})")
        _wait(lambda: sum(i["state"] == "up" for i in _get(controller + "/instances", token=tokens["reader"][0]))
              == 2,
              "both instances registered")
        reader_file = tokens["reader"][1]
        routes = {"round-robin": _route(procs, "route-rr", backends, controller, reader_file, "round-robin"),
                  "flowkv route": _route(procs, "route-prefix", backends, controller, reader_file, "prefix")}
        for mode, url in routes.items():
            _post(controller + "/clear", {"wait_s": 60}, token=tokens["operator"][0])  # both modes start from cold caches
            print(f"{mode}: {len(order)} requests...", file=sys.stderr)
            results[mode] = _workload(url, prompts, order, args.concurrency)
    finally:
        procs.stop()
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)

    if args.json:
        print(json.dumps({mode: {k: v for k, v in r.items() if k != "ttfts_ms"} for mode, r in results.items()},
                         indent=2))
    else:
        _print_table(results, args)
    if args.plot:
        _plot(results, args.plot)
    return 0


def _print_table(results: dict[str, Any], args: argparse.Namespace) -> None:
    base = results["round-robin"]
    print(f"# {args.documents} documents x {args.doc_tokens} tokens, each asked {args.repeats} times, "
          f"concurrency {args.concurrency}, two vLLM instances")
    print(f"{'mode':<14} {'hit rate':>9} {'TTFT p50':>10} {'TTFT p99':>10} {'req/s':>7} {'homes/doc':>10}")
    for mode, r in results.items():
        print(f"{mode:<14} {r['hit_rate']:>8.1%} {r['ttft_p50_ms']:>8.0f}ms {r['ttft_p99_ms']:>8.0f}ms "
              f"{r['requests_per_s']:>7.2f} {r['backends_per_document']:>10.2f}")
    mine = results["flowkv route"]
    print(f"round-robin / flowkv route TTFT p50: {base['ttft_p50_ms'] / mine['ttft_p50_ms']:.2f}x, "
          f"p99: {base['ttft_p99_ms'] / mine['ttft_p99_ms']:.2f}x; flowkv route / round-robin req/s: "
          f"{mine['requests_per_s'] / base['requests_per_s']:.2f}x")


def _plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(results)
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(11, 3.8))
    left.bar(modes, [results[m]["hit_rate"] * 100 for m in modes], color=["#999999", "#2f6fdb"])
    left.set_ylabel("prompt tokens from flowkv (%)")
    left.set_title("hit rate")
    for n, mode in enumerate(modes):
        values = sorted(results[mode]["ttfts_ms"])
        middle.plot([100 * (i + 1) / len(values) for i in range(len(values))], values, marker=".",
                    label=mode, color=["#999999", "#2f6fdb"][n])
    middle.set_xlabel("requests (%)")
    middle.set_ylabel("TTFT (ms)")
    middle.set_title("TTFT distribution")
    middle.legend()
    right.bar(modes, [results[m]["requests_per_s"] for m in modes], color=["#999999", "#2f6fdb"])
    right.set_title("requests / s")
    fig.suptitle("flowkv route vs round-robin, two vLLM instances")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)

