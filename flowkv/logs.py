"""Where flowkv's log lines go, and what they look like.

Every flowkv module logs to a child of the ``flowkv`` logger
(``flowkv.tiers``, ``flowkv.integration``, ...). Left alone, Python prints a
warning from those as its bare message, with no time and no process: useless
beside vLLM's own lines in a server's log. :func:`setup_logging` fixes that
once per process:

- **Inside vLLM** (``inside_vllm=True``): flowkv's records are handed to the
  handlers vLLM configured on its ``vllm`` logger, so they carry vLLM's format
  (process name, pid, level, time, ``[file:line]``), stream and level, and
  follow whatever the user set for vLLM (``VLLM_LOGGING_LEVEL``,
  ``VLLM_LOGGING_CONFIG_PATH``, ``--log-level``). vLLM loads flowkv's
  ``vllm.general_plugins`` entry point (:func:`vllm_plugin`) in each of its
  processes (API server, engine core, workers), which calls this; the
  connector calls it too, for a ``VLLM_PLUGINS`` list without ``flowkv``.
  When vLLM does not configure logging (``VLLM_CONFIGURE_LOGGING=0``), or
  the program running vLLM configured the root logger itself (``vllm.LLM``
  in an application, the ``flowkv`` command, pytest), nothing is changed:
  flowkv's records go where that configuration sends them.
- **Elsewhere** (the ``flowkv`` command, flowkv's own servers): the root
  logger gets a standard handler on stderr, ``FORMAT`` below, unless the
  program configured logging already.

``FLOWKV_LOGGING_LEVEL`` (``DEBUG``, ``INFO``, ...) sets flowkv's level in
both cases; the default is vLLM's level inside vLLM and ``WARNING`` elsewhere.
"""

from __future__ import annotations

import logging
import os

__all__ = ["FORMAT", "setup_logging", "vllm_plugin"]

#: The format of flowkv's lines outside vLLM: time, level, process, logger.
FORMAT = "%(asctime)s %(levelname)s %(processName)s pid=%(process)d %(name)s: %(message)s"
LEVEL_ENV = "FLOWKV_LOGGING_LEVEL"

_FLOWKV = "flowkv"
_VLLM = "vllm"


class _ToVllmHandlers(logging.Handler):
    """Hands each record to the ``vllm`` logger's handlers, as they are at that moment.

    Looked up per record, not copied once: vLLM configures logging in each of
    its processes (before or after it loads plugins) and again after parsing
    ``--log-level``, replacing its handlers each time.
    """

    def emit(self, record: logging.LogRecord) -> None:
        # The handlers' own levels (vLLM's) apply there.
        logging.getLogger(_VLLM).handle(record)


def _env_level() -> int | None:
    name = os.environ.get(LEVEL_ENV, "").strip().upper()
    if not name:
        return None
    level = logging.getLevelName(name)
    return level if isinstance(level, int) else None


def _vllm_configures_logging() -> bool:
    try:
        from vllm import envs
    except ImportError:
        return False
    return bool(envs.VLLM_CONFIGURE_LOGGING)


def _vllm_env_level() -> int:
    from vllm import envs

    level = logging.getLevelName(str(envs.VLLM_LOGGING_LEVEL).upper())
    return level if isinstance(level, int) else logging.INFO


def setup_logging(*, inside_vllm: bool = False) -> None:
    """Give flowkv's log lines a time and a process: vLLM's format inside vLLM, ``FORMAT`` elsewhere.

    Idempotent; call it where a process starts using flowkv::

        from flowkv.logs import setup_logging
        setup_logging(inside_vllm=True)   # in vLLM's processes (the connector, the plugin)
        setup_logging()                   # in the flowkv command
    """
    flowkv_logger = logging.getLogger(_FLOWKV)
    level = _env_level()
    if inside_vllm:
        if any(isinstance(h, _ToVllmHandlers) for h in flowkv_logger.handlers):
            return
        if logging.getLogger().handlers or not _vllm_configures_logging():
            # The program configured logging itself (vLLM in-process, under pytest, or after
            # setup_logging() in the flowkv command), or vLLM leaves it to the program: flowkv's
            # records keep going to the root logger's handlers.
            return
        flowkv_logger.addHandler(_ToVllmHandlers())
        # Like vLLM's own logger: each line once, in vLLM's format, not again through the root's handlers.
        flowkv_logger.propagate = False
        if level is None:
            # vLLM's level, as far as it is known yet (it configures its logger from VLLM_LOGGING_LEVEL).
            vllm_logger = logging.getLogger(_VLLM)
            level = vllm_logger.level if vllm_logger.handlers else _vllm_env_level()
        flowkv_logger.setLevel(level)
        return
    if level is not None:
        flowkv_logger.setLevel(level)
    # A no-op when the program (or a test runner) configured the root logger already.
    logging.basicConfig(format=FORMAT, level=logging.WARNING)


def vllm_plugin() -> None:
    """vLLM's ``vllm.general_plugins`` entry point: run in every vLLM process at start."""
    setup_logging(inside_vllm=True)
