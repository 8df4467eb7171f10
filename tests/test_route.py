"""``flowkv route``'s choices, with a real controller and router process and two small stand-in backends.

The backends are plain HTTP servers in this process that answer
``/v1/completions`` with their own name (a request with ``"hold": true`` is
answered only when the test lets it go, so it stays in flight; a streamed one
with ``"trickle": true`` sends its first piece, then the rest only when the
test lets it go, and logs both to ``events``); the holders
are real ``Reporter`` objects registered with the backends' URLs. Prompts are
token ids, so no tokenizer is involved. A stand-in asked to prefill for a
remote decode (``kv_transfer_params`` ``do_remote_decode``) answers with
``kv_transfer_params`` of its own, as a flowkv prefill instance does. With real
vLLM instances behind it: ``test_controller_vllm.py``, and for disaggregated
prefill ``test_vllm_disagg.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from fleet_helpers import Backend, ControllerProcess, chunk_keys, start_route, stop_fleet, wait_for
from flowkv.fleet.protocol import Registration, TierInfo
from flowkv.fleet.reporter import Reporter, ReporterConfig, new_session

TOKEN = "route-token"


@pytest.fixture
def fleet(tmp_path):
    controller = ControllerProcess(tmp_path / "controller", token=TOKEN, heartbeat_s=0.3, timeout_s=5.0).start()
    backends = {name: Backend(name) for name in ("a", "b")}
    reporters = {}
    for name, backend in backends.items():
        registration = Registration(instance_id=name, session=new_session(), model="m", url=backend.url,
                                    chunk_size=16, hash="sha256", tiers=[TierInfo(name="memory", kind="memory")])
        reporters[name] = Reporter(ReporterConfig(url=controller.url, heartbeat_s=0.3,
                                                  token_file=str(controller.token_file)), registration).start()
    routes: list[subprocess.Popen] = []

    def route(*args: str, to: list[str] | None = None) -> str:
        to = [backends["a"].url, backends["b"].url] if to is None else to
        url, proc = start_route([*[arg for url in to for arg in ("--backend", url)],
                                 "--token-file", str(controller.token_files["reader"]), *args], tmp_path / "route.log")
        routes.append(proc)
        return url

    try:
        yield {"controller": controller, "backends": backends, "reporters": reporters, "route": route}
    finally:
        stop_fleet(routes, list(reporters.values()), list(backends.values()), controller)


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as reply:
        return json.load(reply)


def complete(url: str, prompt: list[int], **extra) -> tuple[dict, dict]:
    body = {"model": "m", "prompt": prompt, "max_tokens": 1, **extra}
    return send(url + "/v1/completions", json.dumps(body).encode())


def send(url: str, raw: bytes) -> tuple[dict, dict]:
    request = urllib.request.Request(url, raw, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.load(reply), dict(reply.headers)


def refusal(url: str, raw: bytes) -> tuple[int, dict]:
    """The status and error body of a request the router is expected to refuse."""
    try:
        send(url, raw)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)
    raise AssertionError(f"{url} accepted {raw[:80]!r}")


def in_flight(url: str) -> list[int]:
    return list(get(url + "/stats")["in_flight"].values())


def hold(url: str, prompt: list[int]) -> threading.Thread:
    """A request that stays in flight until its backend is released."""
    thread = threading.Thread(target=complete, args=(url, prompt), kwargs={"hold": True}, daemon=True)
    thread.start()
    return thread


def admit(fleet, name: str, tokens: list[int], chunks: int) -> None:
    reporter = fleet["reporters"][name]
    for key in chunk_keys(tokens, chunk_size=16)[:chunks]:
        reporter.offer("admit", "memory", key)
    assert reporter.wait_idle(60)


DOC = list(range(2000, 2128))  # 8 chunks of 16


def test_the_longest_cached_prefix_wins_and_a_tie_goes_to_the_less_loaded(fleet):
    url = fleet["route"]("--controller", fleet["controller"].url, "--lookup-timeout-s", "30")
    admit(fleet, "a", DOC, 2)
    admit(fleet, "b", DOC, 5)
    reply, headers = complete(url, DOC)
    assert reply["backend"] == "b"
    assert headers["x-flowkv-route"] == "longest-prefix" and headers["x-flowkv-matched-tokens"] == "80"

    # Equal prefixes: the one with fewer requests in flight (a request held at b keeps it busier).
    admit(fleet, "a", DOC, 5)
    busy = hold(url, list(range(90_000, 90_040)))
    wait_for(lambda: fleet["backends"]["a"].held + fleet["backends"]["b"].held == 1, "one request is held")
    loaded = "a" if fleet["backends"]["a"].held else "b"
    reply, headers = complete(url, DOC)
    assert headers["x-flowkv-route"] == "tie-by-load" and reply["backend"] != loaded
    fleet["backends"][loaded].release.set()
    busy.join(60)


def test_a_holder_too_far_ahead_in_requests_in_flight_is_passed_over(fleet):
    url = fleet["route"]("--controller", fleet["controller"].url, "--lookup-timeout-s", "30",
                         "--max-in-flight-gap", "1")
    admit(fleet, "a", DOC, 8)
    # Two requests held at a (each a prompt that a holds a prefix of, so both go there).
    held = [hold(url, DOC + [n]) for n in range(2)]
    wait_for(lambda: fleet["backends"]["a"].held == 2, "two requests are held at a")
    reply, _ = complete(url, DOC)
    assert reply["backend"] == "b"  # a is 2 ahead of b, more than the gap of 1
    stats = get(url + "/stats")
    assert stats["decisions"]["holder_overloaded"] >= 1 and stats["in_flight"][fleet["backends"]["a"].url] == 2
    fleet["backends"]["a"].release.set()
    for thread in held:
        thread.join(60)
    wait_for(lambda: get(url + "/stats")["in_flight"][fleet["backends"]["a"].url] == 0, "a's requests are done")
    assert complete(url, DOC)[0]["backend"] == "a"


def test_a_new_prompt_sticks_to_where_its_opening_went_and_streams_pass_through(fleet):
    url = fleet["route"]("--controller", fleet["controller"].url, "--lookup-timeout-s", "30")
    fresh = list(range(7000, 7100))
    first, headers = complete(url, fresh)
    assert headers["x-flowkv-route"] == "no-holder"
    for _ in range(3):  # nobody reported it yet: the same opening goes to the same backend
        reply, headers = complete(url, fresh)
        assert reply["backend"] == first["backend"] and headers["x-flowkv-route"] == "recent-affinity"

    body = {"model": "m", "prompt": fresh, "max_tokens": 1, "stream": True}
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        lines = [line.decode().strip() for line in reply if line.strip()]
    assert lines[-1] == "data: [DONE]"
    assert [json.loads(line[len("data: "):])["n"] for line in lines[:-1]] == [0, 1, 2]


def test_round_robin_alternates_and_a_missing_controller_falls_back_to_load(fleet):
    url = fleet["route"]("--policy", "round-robin")
    admit(fleet, "a", DOC, 8)
    served = [complete(url, DOC)[0]["backend"] for _ in range(4)]
    assert served in (["a", "b", "a", "b"], ["b", "a", "b", "a"])

    fleet["controller"].kill()
    url = fleet["route"]("--controller", fleet["controller"].url, "--lookup-timeout-s", "2")
    replies = [complete(url, DOC) for _ in range(2)]
    assert {headers["x-flowkv-route"] for _, headers in replies} == {"lookup-failed"}
    assert sorted(reply["backend"] for reply, _ in replies) == ["a", "b"]


def test_a_body_that_is_not_a_json_object_is_refused_before_a_backend_is_asked(fleet):
    url = fleet["route"]("--policy", "round-robin", "--max-body-bytes", "4096")
    for path in ("/v1/completions", "/v1/chat/completions"):
        for raw in (b"[1]", b'"text"', b"7", b"null", b"{not json", b"[" * 4000):
            status, error = refusal(url + path, raw)
            assert status == 400 and error["error"]["type"] == "invalid_request", (path, raw[:20], error)
        status, error = refusal(url + path, json.dumps({"prompt": "x" * 5000}).encode())
        assert status == 413 and "4096" in error["error"]["message"]
    assert in_flight(url) == [0, 0]
    assert fleet["backends"]["a"].bodies == fleet["backends"]["b"].bodies == []
    reply, headers = complete(url, DOC)  # and the router still serves
    assert reply["backend"] in ("a", "b") and in_flight(url) == [0, 0]


def test_a_backend_that_is_down_or_silent_answers_502_or_504_and_leaves_nothing_in_flight(fleet):
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
    url = fleet["route"]("--policy", "round-robin", to=[dead])
    for raw in (json.dumps({"model": "m", "prompt": DOC}).encode(),
                json.dumps({"model": "m", "prompt": DOC, "stream": True}).encode()):
        status, error = refusal(url + "/v1/completions", raw)
        assert status == 502 and error["error"]["type"] == "backend_error" and dead in error["error"]["message"]
    assert get(url + "/stats")["in_flight"] == {dead: 0}

    backend = fleet["backends"]["a"]
    url = fleet["route"]("--policy", "round-robin", "--read-timeout-s", "0.5", to=[backend.url])
    status, error = refusal(url + "/v1/completions", json.dumps({"model": "m", "prompt": DOC, "hold": True}).encode())
    assert status == 504 and backend.held == 1
    assert in_flight(url) == [0]
    backend.release.set()
    assert complete(url, DOC)[0]["backend"] == "a" and in_flight(url) == [0]


def test_chat_and_streamed_completions_pass_through_a_stream_piece_by_piece(fleet):
    backend = fleet["backends"]["a"]
    url = fleet["route"]("--policy", "round-robin", to=[backend.url])
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    reply, headers = send(url + "/v1/chat/completions", json.dumps(body).encode())
    assert reply["backend"] == "a" and headers["x-flowkv-backend"] == backend.url
    assert backend.bodies[-1] == body

    body = {"model": "m", "prompt": DOC, "stream": True, "trickle": True}
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        first = reply.readline().decode().strip()
        # The first piece came through while the backend was still waiting to send the rest.
        backend.events.append("client read the first piece")
        backend.go_on.set()
        rest = [line.decode().strip() for line in reply if line.strip()]
    assert json.loads(first[len("data: "):]) == {"backend": "a", "n": 0}
    assert backend.events == ["backend sent its first piece", "client read the first piece", "backend finished"]
    assert rest[-1] == "data: [DONE]" and [json.loads(line[6:])["n"] for line in rest[:-1]] == [1, 2]
    wait_for(lambda: in_flight(url) == [0], "the stream's request is done")


# -- disaggregated prefill: --prefill / --decode --------------------------------------------


def dead_url() -> str:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


def test_a_request_is_prefilled_for_one_token_then_decoded_with_what_the_prefill_answered(fleet):
    prefill, decode = fleet["backends"]["a"], fleet["backends"]["b"]
    url = fleet["route"]("--prefill", prefill.url, "--decode", decode.url, to=[])
    tagged = {"flowkv.tag.tenant": "t1"}
    body = {"model": "m", "prompt": DOC, "max_tokens": 12, "n": 1, "min_tokens": 4, "kv_transfer_params": tagged}
    reply, headers = send(url + "/v1/completions", json.dumps(body).encode())
    assert reply["backend"] == "b" and headers["x-flowkv-backend"] == decode.url
    assert headers["x-flowkv-prefill"] == prefill.url
    [asked] = prefill.bodies
    # One token, not streamed, asking for a remote decode; the client's tags kept (they are in the keys).
    assert asked == {"model": "m", "prompt": DOC, "max_tokens": 1, "stream": False,
                     "kv_transfer_params": {**tagged, "do_remote_decode": True, "do_remote_prefill": False}}
    [decoded] = decode.bodies
    assert decoded == {**body, "kv_transfer_params": {**tagged, "do_remote_prefill": True, "do_remote_decode": False,
                                                      "flowkv_committed_tokens": 96, "prefilled_by": "a"}}
    stats = get(url + "/stats")
    assert stats["decisions"]["prefilled"] == 1 and stats["prefill_in_flight"] == {prefill.url: 0}
    assert get(url + "/health")["prefill"] == [prefill.url]


def test_a_streamed_chat_is_prefilled_unstreamed_and_its_decode_streams_through(fleet):
    prefill, decode = fleet["backends"]["a"], fleet["backends"]["b"]
    url = fleet["route"]("--prefill", prefill.url, "--decode", decode.url, to=[])
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}, "max_completion_tokens": 30}
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert reply.headers["x-flowkv-prefill"] == prefill.url
        lines = [line.decode().strip() for line in reply if line.strip()]
    assert lines[-1] == "data: [DONE]" and [json.loads(line[6:])["n"] for line in lines[:-1]] == [0, 1, 2]
    [asked] = prefill.bodies
    assert asked["stream"] is False and asked["max_tokens"] == 1
    assert "stream_options" not in asked and "max_completion_tokens" not in asked
    [decoded] = decode.bodies
    assert decoded["stream"] is True and decoded["max_completion_tokens"] == 30
    assert decoded["kv_transfer_params"]["flowkv_committed_tokens"] == 96
    wait_for(lambda: in_flight(url) == [0], "the stream's request is done")


def test_a_prefill_instance_down_leaves_the_prompt_to_the_decode_instance_and_is_passed_over(fleet):
    decode = fleet["backends"]["b"]
    dead = dead_url()
    url = fleet["route"]("--prefill", dead, "--decode", decode.url, "--prefill-retry-s", "600", to=[])
    for n in range(3):
        reply, headers = complete(url, DOC, max_tokens=5)
        assert reply["backend"] == "b"
        assert headers["x-flowkv-prefill"] == (dead if n == 0 else "none")
    # No prefill params: the decode instance computes the prompt (and loads whatever the tier holds).
    assert all("kv_transfer_params" not in body for body in decode.bodies) and len(decode.bodies) == 3
    decisions = get(url + "/stats")["decisions"]
    assert decisions["prefill-failed"] == 1 and decisions["prefill-none-up"] == 2
    assert get(url + "/stats")["prefill_in_flight"] == {dead: 0}


def test_a_prefill_instance_that_refuses_a_request_costs_only_the_split(fleet):
    prefill, decode = fleet["backends"]["a"], fleet["backends"]["b"]
    url = fleet["route"]("--prefill", prefill.url, "--decode", decode.url, to=[])
    reply, headers = complete(url, DOC, refuse_prefill=True)
    assert reply["backend"] == "b" and headers["x-flowkv-prefill"] == prefill.url
    assert "kv_transfer_params" not in decode.bodies[-1] and len(prefill.bodies) == 1
    # Refused is not down: the next request is prefilled there again.
    reply, headers = complete(url, DOC)
    assert decode.bodies[-1]["kv_transfer_params"]["prefilled_by"] == "a" and len(prefill.bodies) == 2
    assert get(url + "/stats")["decisions"]["prefill-refused"] == 1


@pytest.mark.parametrize("args", [["--prefill", "http://127.0.0.1:1"],
                                  ["--decode", "http://127.0.0.1:1"],
                                  ["--backend", "http://127.0.0.1:1", "--prefill", "http://127.0.0.1:2",
                                   "--decode", "http://127.0.0.1:3"],
                                  []])
def test_route_wants_backends_or_prefill_and_decode_instances(args):
    done = subprocess.run([str(Path(sys.executable).parent / "flowkv"), "route", "--port", "0", *args],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 2
    assert "--prefill URL and --decode URL" in done.stderr


def test_the_readme_disaggregated_prefill_route_line_is_one_flowkv_route_takes():
    from flowkv.cli import build_parser
    from vllm_server import README, shell_commands

    [argv] = [argv for _, argv in shell_commands(README.read_text(encoding="utf-8"))
              if argv[:2] == ["flowkv", "route"] and "--prefill" in argv]
    args = build_parser().parse_args(argv[1:])
    assert args.prefill == ["http://127.0.0.1:8100"] and args.decode == ["http://127.0.0.1:8200"]
    assert args.backend is None
