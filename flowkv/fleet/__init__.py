"""The fleet: many vLLM instances with flowkv, one controller, a KV-aware router.

::

    vLLM A (worker: Reporter) ─┐  register, heartbeat, admit/evict events (seq-numbered)
    vLLM B (worker: Reporter) ─┼──────────────────────────────▶ flowkv controller
    flowkv node-report        ─┘                                 Directory (soft state)
                                                                 /lookup /instances /clear /pin
    client ─▶ flowkv route ──/lookup──▶ controller               /prefetch /metrics, dashboard at /
                  └──▶ the instance with the longest cached prefix

- :mod:`flowkv.fleet.protocol`: the messages between reporters and the controller.
- :mod:`flowkv.fleet.directory`: who holds which chunk, rebuilt from events and resyncs.
- :mod:`flowkv.fleet.controller`: the controller's HTTP API and dashboard (``flowkv controller``).
- :mod:`flowkv.fleet.access`: who may call what: the controller's roles and tokens, allowed hosts, bounds.
- :mod:`flowkv.fleet.reporter`: the client side, in each vLLM worker (and node-report).
- :mod:`flowkv.fleet.holder`: a ``CacheEngine`` as a holder (its events, stats and commands).
- :mod:`flowkv.fleet.node`: a node server (``flowkv server``) followed into the controller
  (``flowkv node-report``).
- :mod:`flowkv.fleet.route`: the OpenAI-compatible KV-aware proxy (``flowkv route``).

The core never imports this package; the vLLM connector imports the reporter.
"""
