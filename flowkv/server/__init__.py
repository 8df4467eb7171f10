"""``flowkv server``: one flowkv cache per node, shared by every vLLM on it.

- :mod:`flowkv.server.daemon` — the server (``NodeServer``): the shared arena,
  the storage manager with the lower tiers, the request handlers;
- :mod:`flowkv.server.leases` — sessions, handles and pins, and when they are reclaimed;
- :mod:`flowkv.server.metrics` — Prometheus metrics (``--metrics-port``);
- :mod:`flowkv.server.cli` — ``flowkv server`` and ``flowkv server status``.

Clients reach it through the ``server`` tier (:mod:`flowkv.tiers.server`), and
anything else through :class:`flowkv.tiers.node_protocol.NodeConnection`;
neither imports this package.
"""
