"""The local-disk tier: one file per chunk payload, LRU-evicted by bytes.

Layout under ``path``::

    path/
      3f/                          first hex byte of the key's digest (256 shards)
        3f9a0c...e1.kv             one payload; name = blake2b-128(key) in hex (the default tenant's)
        3f9a0c...e1.61636d65.kv    one of tenant "acme": its name's UTF-8 in hex, so a restart knows it
        .3f9a0c...e1.4711.a1b2.tmp a write in progress (removed on start)

Keys are opaque strings (they may hold ``/``), so a file is named by a digest
of its key, never by the key itself. A write goes to a temporary name in the
same folder and is renamed over the final name with ``os.replace``: a crash
leaves either the old state or a complete file, never a half file under a
valid name (with ``fsync = true`` this also holds across power loss). Every
read is checked with :func:`flowkv.tiers.verify_payload`; a corrupt or
truncated file is a miss, counted, and removed.

Who may read it: the folder and its shards are created 0700 and every file
0600 (whatever the umask), so other users on the machine cannot read the
prompts' KV. An existing folder owned by another user is refused (an error
in the log, then every read misses and every write is dropped): whoever
owns it could read, replace or plant entries. A folder of this user with a
looser mode (made by an older flowkv) is tightened to 0700. Entries are
opened without following symbolic links, and only a regular file of this
user, exactly the size the index holds, is read: a symlink, FIFO or device
planted as an entry is a miss (and removed), never followed, never waited
on, never read past its indexed size.

A full filesystem: ``capacity`` is what the tier may hold, not what the
filesystem has room for. At start, and whenever a write fails with ``ENOSPC``
(or ``EDQUOT``), the tier measures the filesystem (``statvfs``) and lowers its
*effective* capacity to what it holds plus the free space, less 1/64 of the
filesystem kept free for file-system overhead; it then evicts least recently
used entries down to that and writes the failed entries once more. While
writes still fail for lack of space the tier reports ``degraded = 1`` (its
guard then reports it unhealthy) and warns, at most once a minute, with what
it did. The effective capacity grows back towards ``capacity`` when space is
freed (measured again at most every 30 s).

The index (digest → size, in LRU order) lives in memory and is rebuilt from
the folder when the tier starts, ordered by the files' access times, so a
restarted engine finds the cache warm. File I/O runs in worker threads
(``anyio.to_thread.run_sync``).

TOML::

    [tiers.local-disk]
    kind = "disk"
    path = "/var/cache/flowkv"
    capacity = "20GiB"
    admit_after = 2               # store a chunk only the second time it is offered
    fsync = false
    quotas = { default = "2GiB", acme = "10GiB" }   # per tenant (flowkv.tenants)

With ``quotas``, a write of a tenant at its quota evicts that tenant's own
least recently used files first (and is dropped when it has none to give),
and a full folder takes files of tenants over their quota (a quota lowered
since the last start) before anyone else's; then plain LRU.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import secrets
import stat
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import anyio.to_thread
import attrs

from flowkv.registry import tier
from flowkv.sizes import format_size
from flowkv.tenants import DEFAULT_TENANT, DEFAULT_TENANT_LABELS, TenantLedger, clean_tenant
from flowkv.tiers.base import Tier, verify_payload

__all__ = ["DiskTier", "DiskTierConfig"]

logger = logging.getLogger("flowkv.tiers")

_SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"
_DIGEST_BYTES = 16
# Admission remembers this many recently offered keys; older ones start over.
_SEEN_LIMIT = 1 << 18
# Out-of-space errors: the filesystem (or the user's quota) is full.
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# The share of the filesystem the tier leaves free (block rounding, folders, other files).
_HEADROOM_FRACTION = 64
_PRIVATE_FOLDER = 0o700
_PRIVATE_FILE = 0o600
# An entry is opened as itself (never through a symlink), and a FIFO's open returns at once.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# At most one out-of-space warning per tier this often; the rest are counted into the next.
_WARN_INTERVAL_S = 60.0
# While the effective capacity is below the configured one, look for freed space this often.
_REMEASURE_INTERVAL_S = 30.0


def _positive_int(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"disk tier {attribute.name} must be a positive integer, got {value!r}")


@attrs.define(frozen=True, kw_only=True)
class DiskTierConfig:
    """Settings of a :class:`DiskTier`."""

    #: Folder holding the cache; created when missing. One engine process per folder.
    path: str = attrs.field(converter=os.fspath)
    #: Bytes of payload the folder may hold; the least recently used go first.
    #: (The pipeline loader turns ``"20GiB"`` into bytes.)
    capacity: int = attrs.field(validator=_positive_int)
    #: Store a key only once it has been offered this many times (1 = always).
    admit_after: int = attrs.field(default=1, validator=_positive_int)
    #: fsync each file and its folder before it counts as stored (survives power loss).
    fsync: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    #: Bytes each tenant may hold ({} = no quotas; "default" = every tenant not named): flowkv.tenants.
    quotas: dict[str, int] = attrs.field(factory=dict, hash=False)
    #: Tenants with their own metric label; later ones count under "default".
    tenant_labels: int = DEFAULT_TENANT_LABELS


def key_digest(key: str) -> str:
    """The hex digest naming ``key``'s file (stable across processes)."""
    if not isinstance(key, str):
        raise TypeError(f"tier keys are str (CacheKey.to_str()), got {type(key).__name__}")
    return hashlib.blake2b(key.encode("utf-8"), digest_size=_DIGEST_BYTES).hexdigest()


def _is_digest_name(name: str) -> bool:
    return _parse_name(name) is not None


def _parse_name(name: str) -> tuple[str, str] | None:
    """(digest, tenant) of a payload file's name, or None when it is not one."""
    if not name.endswith(_SUFFIX):
        return None
    digest, _, owner = name[: -len(_SUFFIX)].partition(".")
    if len(digest) != 2 * _DIGEST_BYTES or not all(c in "0123456789abcdef" for c in digest):
        return None
    if not owner:
        return digest, DEFAULT_TENANT
    try:
        tenant = bytes.fromhex(owner).decode("utf-8")
    except ValueError:
        return None
    return (digest, tenant) if clean_tenant(tenant) == tenant and tenant != DEFAULT_TENANT else None


def _file_name(digest: str, tenant: str) -> str:
    return digest + _SUFFIX if tenant == DEFAULT_TENANT else f"{digest}.{tenant.encode('utf-8').hex()}{_SUFFIX}"


@tier("disk", config=DiskTierConfig)
class DiskTier(Tier):
    """Chunk payloads as files in a sharded folder, with LRU eviction by bytes.

    Built by the registry as ``DiskTier(name="local-disk", config=DiskTierConfig(...))``.
    A folder that cannot be created or written does not raise: reads miss and
    writes are dropped, counted in :meth:`stats` (``read_errors``, ``write_errors``).
    A full filesystem lowers the effective capacity (see the module's docstring).
    ``clock`` (monotonic seconds) paces warnings and re-measuring; tests pass their own.
    """

    tenants = True  # put takes (key, payload, tenant): the tenant is part of each file's name

    def __init__(
        self,
        *,
        name: str,
        config: DiskTierConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.config = config
        self.root = Path(config.path).expanduser()
        self._clock = clock
        # What the tier may hold now: the configured capacity, or less while the filesystem has no room.
        self._capacity = config.capacity
        self._degraded = False  # the last write that wanted space found none, even after eviction
        self._measured_at = clock()
        self._warned_at: float | None = None  # when the last out-of-space warning went out
        self._unwarned_failures = 0  # writes failed for lack of space since that warning
        self._warned_degraded = False  # that warning said writes are failing, and no recovery was logged since
        self._index: OrderedDict[str, int] = OrderedDict()  # digest -> bytes, least recent first
        self._bytes_used = 0  # sum of the index's sizes
        # digest -> its tenant (entries indexed, and writes in flight): part of the file's name.
        self._owner: dict[str, str] = {}
        self._by_tenant: dict[str, OrderedDict[str, None]] = {}  # tenant -> its digests, least recent first
        self._ledger = TenantLedger(config.quotas, labels=config.tenant_labels)
        self._reserved = 0  # bytes of writes in flight, already made room for
        self._writing: set[str] = set()  # digests being written now
        self._seen: OrderedDict[str, int] = OrderedDict()  # digest -> times offered (admission)
        self._made_shards: set[str] = set()
        #: why the folder is not used (another user's), or None
        self.refused: str | None = None
        self._counters = dict.fromkeys(
            (
                "hits",
                "misses",
                "corrupt",
                "read_errors",
                "writes",
                "written_bytes",
                "write_errors",
                "evictions",
                "evicted_bytes",
                "admission_declined",
                "too_large",
                "temp_files_removed",
                "nospace_errors",
                "capacity_shrinks",
                "refused_calls",
            ),
            0,
        )
        self._rebuild_index()

    # -- the Tier contract -------------------------------------------------

    async def exists(self, keys: list[str]) -> list[bool]:
        return [key_digest(key) in self._index for key in keys]

    async def get(self, keys: list[str], tenant: str | None = None) -> list[bytes | None]:
        """Payloads of ``keys``; hits and misses count for ``tenant`` (the reader; default: a hit's owner)."""
        reader = clean_tenant(tenant) if tenant is not None else None
        if self.refused:
            self._counters["refused_calls"] += 1
            self._counters["misses"] += len(keys)
            return [None] * len(keys)
        digests = [key_digest(key) for key in keys]
        wanted = [d for d in dict.fromkeys(digests) if d in self._index]
        for digest in wanted:
            self._touch(digest)
        named = dict(zip(digests, keys))
        found = await anyio.to_thread.run_sync(self._read_files, {d: named[d] for d in wanted}) if wanted else {}
        for digest, outcome in found.items():
            if isinstance(outcome, bytes):
                continue
            self._unindex(digest, evicted=False)
            self._owner.pop(digest, None)
            if outcome in self._counters:
                self._counters[outcome] += 1
        results: list[bytes | None] = []
        for digest in digests:
            blob = found.get(digest)
            if isinstance(blob, bytes):
                self._counters["hits"] += 1
                self._ledger.hit(reader or self._owner.get(digest, DEFAULT_TENANT))
                results.append(blob)
            else:
                self._counters["misses"] += 1
                self._ledger.miss(reader or DEFAULT_TENANT)
                results.append(None)
        return results

    async def put(self, entries: list[tuple[str, bytes] | tuple[str, bytes, str]]) -> None:
        """Write ``(key, payload)`` or ``(key, payload, tenant)`` entries (the default tenant's when unnamed)."""
        if self.refused:
            self._counters["refused_calls"] += 1
            return
        plan: list[tuple[str, bytes]] = []
        quota_victims: list[str] = []
        for key, payload, *named in entries:
            tenant = clean_tenant(named[0]) if named else DEFAULT_TENANT
            if not isinstance(payload, (bytes, bytearray, memoryview)):
                raise TypeError(f"disk tier {self.name!r}: payload for {key!r} is {type(payload).__name__}, not bytes")
            digest = key_digest(key)
            if digest in self._index:
                # Same key, same payload: refresh its recency instead of rewriting.
                self._touch(digest)
                continue
            if digest in self._writing or not self._admit(digest):
                continue
            size = len(payload)
            if size > self.config.capacity:
                self._counters["too_large"] += 1
                continue
            if not self._within_quota(tenant, size, quota_victims):
                continue
            self._writing.add(digest)
            self._owner[digest] = tenant
            self._ledger.add(tenant, size, entries=0)  # in flight: counts towards its quota until written
            plan.append((digest, payload))
        if quota_victims:
            await anyio.to_thread.run_sync(self._remove_files, quota_victims)
        if not plan:
            return
        try:
            self._remeasure_if_due()
            no_space = await self._write_plan(plan)
            if no_space:
                # The filesystem is fuller than the capacity says: shrink to what it holds, evict, retry once.
                evictions, evicted_bytes = self._counters["evictions"], self._counters["evicted_bytes"]
                self._shrink_to_filesystem()
                no_space = await self._write_plan(no_space)
                evicted = (self._counters["evictions"] - evictions, self._counters["evicted_bytes"] - evicted_bytes)
                self._note_no_space(evicted, failed=len(no_space))
            else:
                self._set_degraded(False)
            # A batch larger than the room left (or a capacity lowered meanwhile) overshoots: shed the oldest.
            victims = self._make_room(0)
            if victims:
                await anyio.to_thread.run_sync(self._remove_files, victims)
        finally:
            for digest, payload in plan:
                self._writing.discard(digest)
                tenant = self._owner.get(digest, DEFAULT_TENANT)
                self._ledger.remove(tenant, len(payload), entries=0)
                if digest not in self._index:
                    self._owner.pop(digest, None)  # not written: no file carries its name

    async def _write_plan(self, plan: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
        """Make room for and write ``plan``; index what was stored, return what failed for lack of space.

        An entry larger than the effective capacity (shrunk below the configured
        one by a full filesystem) is not tried: it also lacks space.
        """
        fitting, no_space = [], []
        for digest, payload in plan:
            (fitting if len(payload) <= self._capacity else no_space).append((digest, payload))
        needed = sum(len(payload) for _, payload in fitting)
        # Also when nothing fits: a capacity just lowered may be below what the folder holds.
        victims = self._make_room(needed)
        if not fitting and not victims:
            return no_space
        self._reserved += needed
        try:
            outcomes = await anyio.to_thread.run_sync(self._write_files, fitting, victims)
        finally:
            self._reserved -= needed
        for (digest, payload), outcome in zip(fitting, outcomes):
            if outcome == "stored":
                self._reindex(digest, len(payload), self._owner.get(digest, DEFAULT_TENANT))
                self._counters["writes"] += 1
                self._counters["written_bytes"] += len(payload)
            elif outcome == "no_space":
                self._counters["nospace_errors"] += 1
                no_space.append((digest, payload))
            else:
                self._counters["write_errors"] += 1
        return no_space

    async def aclose(self) -> None:
        # Files are closed after every operation; the folder stays for the next start.
        self._seen.clear()

    def stats(self) -> dict[str, int | float]:
        """Counters, ``capacity`` (effective) and ``configured_capacity`` in bytes, ``degraded`` (1/0)."""
        return {
            **self._counters,
            "entries": len(self._index),
            "bytes_used": self._bytes_used,
            "capacity": self._capacity,
            "configured_capacity": self.config.capacity,
            "degraded": int(self._degraded),
            "refused_folder": int(self.refused is not None),
            "tenants": self._ledger.report(),
        }

    # -- index and policy (event-loop thread) ------------------------------

    def _admit(self, digest: str) -> bool:
        if self.config.admit_after <= 1:
            return True
        seen = self._seen.pop(digest, 0) + 1
        if seen >= self.config.admit_after:
            return True
        self._seen[digest] = seen
        if len(self._seen) > _SEEN_LIMIT:
            self._seen.popitem(last=False)
        self._counters["admission_declined"] += 1
        return False

    def _make_room(self, needed: int) -> list[str]:
        """Take entries out of the index until ``needed`` fits: tenants over their quota first, then LRU."""
        victims: list[str] = []
        while self._index and self._bytes_used + self._reserved + needed > self._capacity:
            digest = None
            if self._ledger.quotas:  # the over-quota tenants' own oldest (few tenants, many files)
                over = [t for t in self._by_tenant if self._ledger.over_quota(t)]
                digest = next(iter(self._by_tenant[over[0]])) if over else None
            if digest is None:
                digest = next(iter(self._index))
            self._evict(digest)
            victims.append(digest)
        return victims

    def _within_quota(self, tenant: str, size: int, victims: list[str]) -> bool:
        """Evict ``tenant``'s own least recently used entries until ``size`` more fits its quota
        (appending them to ``victims``); False, counted, when they do not suffice."""
        while self._ledger.over_quota(tenant, size):
            own = self._by_tenant.get(tenant)
            if not own:
                self._ledger.refused(tenant)
                return False
            victim = next(iter(own))
            self._evict(victim)
            victims.append(victim)
        return True

    def _evict(self, digest: str) -> None:
        size = self._unindex(digest, evicted=True)
        self._counters["evictions"] += 1
        self._counters["evicted_bytes"] += size or 0

    def _reindex(self, digest: str, size: int, tenant: str) -> None:
        self._index[digest] = size
        self._bytes_used += size
        self._owner[digest] = tenant
        self._by_tenant.setdefault(tenant, OrderedDict())[digest] = None
        self._ledger.add(tenant, size)

    def _unindex(self, digest: str, *, evicted: bool) -> int | None:
        """Drop ``digest`` from the index (its owner stays until its file is removed); its size."""
        size = self._index.pop(digest, None)
        if size is None:
            return None
        self._bytes_used -= size
        tenant = self._owner.get(digest, DEFAULT_TENANT)
        own = self._by_tenant.get(tenant)
        if own is not None:
            own.pop(digest, None)
            if not own:
                del self._by_tenant[tenant]
        self._ledger.remove(tenant, size, evicted=evicted)
        return size

    def _touch(self, digest: str) -> None:
        self._index.move_to_end(digest)
        own = self._by_tenant.get(self._owner.get(digest, DEFAULT_TENANT))
        if own is not None and digest in own:
            own.move_to_end(digest)

    # -- room on the filesystem (event-loop thread) --------------------------

    def _measure(self) -> tuple[int, int] | None:
        """(the most the tier can hold on its filesystem now, the free bytes there), or None.

        What fits is what the tier holds plus the free space, less 1/64 of the
        filesystem left free (block rounding, folders), and never more than the
        configured capacity.
        """
        try:
            fs = os.statvfs(self.root)
        except OSError:
            return None
        free = fs.f_bavail * fs.f_frsize
        headroom = fs.f_blocks * fs.f_frsize // _HEADROOM_FRACTION
        fitting = max(0, min(self.config.capacity, self._bytes_used + self._reserved + free - headroom))
        return fitting, free

    def _shrink_to_filesystem(self) -> None:
        """After an out-of-space write: lower the effective capacity to what the filesystem holds."""
        measured = self._measure()
        # A write just failed for lack of space, so what the tier holds now is the most that fitted;
        # statvfs may show less (others' files, the headroom) or more (a quota it does not see).
        target = self._bytes_used if measured is None else min(self._bytes_used, measured[0])
        if target < self._capacity:
            self._capacity = target
            self._counters["capacity_shrinks"] += 1
        self._measured_at = self._clock()

    def _remeasure_if_due(self) -> None:
        """Let the capacity grow back (up to the configured one) once space was freed."""
        if self._capacity >= self.config.capacity or self._clock() - self._measured_at < _REMEASURE_INTERVAL_S:
            return
        self._measured_at = self._clock()
        measured = self._measure()
        if measured is not None and measured[0] > self._capacity:
            logger.info("disk tier %r: capacity raised from %s to %s (space was freed)",
                        self.name, format_size(self._capacity), format_size(measured[0]))
            self._capacity = measured[0]

    def _note_no_space(self, evicted: tuple[int, int], *, failed: int) -> None:
        """Record the outcome of an out-of-space retry and warn, at most once per interval."""
        self._set_degraded(failed > 0)
        self._unwarned_failures += failed
        self._counters["write_errors"] += failed
        now = self._clock()
        if self._warned_at is not None and now - self._warned_at < _WARN_INTERVAL_S:
            return
        self._warned_at = now
        self._warned_degraded = self._degraded
        entries, nbytes = evicted
        logger.warning(
            "disk tier %r: the filesystem of %s is full; capacity lowered to %s (configured %s), %d entries "
            "(%s) evicted to make room; %d write(s) failed for lack of space since the last warning%s",
            self.name, self.root, format_size(self._capacity), format_size(self.config.capacity),
            entries, format_size(nbytes), self._unwarned_failures,
            "; writes are failing (degraded)" if self._degraded else "",
        )
        self._unwarned_failures = 0

    def _set_degraded(self, degraded: bool) -> None:
        if not degraded and self._warned_degraded:
            # Said once per warned episode, so a flapping disk costs at most two lines a minute.
            logger.warning("disk tier %r: writes succeed again (capacity %s of %s configured)",
                           self.name, format_size(self._capacity), format_size(self.config.capacity))
            self._warned_degraded = False
        self._degraded = degraded

    def _fit_to_filesystem(self) -> None:
        """At start: a capacity larger than the filesystem can hold is lowered, with a warning."""
        measured = self._measure()
        if measured is None or measured[0] >= self._capacity:
            return
        fitting, free = measured
        logger.warning(
            "disk tier %r: capacity %s is more than the filesystem of %s can hold (%s in the cache, %s free); "
            "using %s",
            self.name, format_size(self.config.capacity), self.root, format_size(self._bytes_used),
            format_size(free), format_size(fitting),
        )
        self._capacity = fitting
        self._counters["capacity_shrinks"] += 1

    def _path(self, digest: str) -> Path:
        return self.root / digest[:2] / _file_name(digest, self._owner.get(digest, DEFAULT_TENANT))

    def _claim_folder(self) -> None:
        """Make the folder 0700, or check that an existing one is this user's (and tighten it)."""
        self.root.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(self.root, _PRIVATE_FOLDER)
        except FileExistsError:
            pass
        info = os.stat(self.root)
        if not stat.S_ISDIR(info.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(self.root))
        if info.st_uid != os.geteuid():
            self.refused = (f"{self.root} is owned by uid {info.st_uid}, not this process's uid {os.geteuid()}: "
                            f"whoever owns it could read, replace or plant cache entries. Give the tier a "
                            f"folder of its own (path = ...), or chown it to this user")
            return
        if info.st_mode & 0o077:
            logger.info("disk tier %r: tightening %s from %o to 700", self.name, self.root, info.st_mode & 0o777)
            os.chmod(self.root, _PRIVATE_FOLDER)

    def _rebuild_index(self) -> None:
        try:
            self._claim_folder()
            if self.refused:
                logger.error("disk tier %r: refusing %s; the tier misses", self.name, self.refused)
                return
            found = self._scan()
        except OSError as exc:
            logger.warning("disk tier %r: cannot use %s (%s); it will miss", self.name, self.root, exc)
            return
        found.sort(key=lambda entry: entry[0])
        for _, name, size in found:
            digest, tenant = _parse_name(name)  # type: ignore[misc]  # _scan kept only payload names
            if digest in self._index:  # one key under two tenants' names (a crash between writes): keep one
                continue
            self._reindex(digest, size, tenant)
        self._fit_to_filesystem()
        # A smaller capacity than last time (or than the filesystem holds): shed the oldest now;
        # a tenant over a quota lowered since: its own oldest.
        victims = self._make_room(0)
        for tenant in list(self._by_tenant):
            self._within_quota(tenant, 0, victims)
        if victims:
            self._remove_files(victims)
        logger.info(
            "disk tier %r: %d entries, %d bytes found in %s", self.name, len(self._index), self._bytes_used, self.root
        )

    def _scan(self) -> list[tuple[float, str, int]]:
        found: list[tuple[float, str, int]] = []
        with os.scandir(self.root) as shards:
            for shard in shards:
                if len(shard.name) != 2 or not shard.is_dir(follow_symlinks=False):
                    continue
                info = shard.stat(follow_symlinks=False)
                if info.st_uid != os.geteuid():
                    logger.warning("disk tier %r: skipping %s, owned by uid %d", self.name, shard.path, info.st_uid)
                    continue
                if info.st_mode & 0o077:
                    os.chmod(shard.path, _PRIVATE_FOLDER)
                self._made_shards.add(shard.name)
                with os.scandir(shard.path) as files:
                    for entry in files:
                        name = entry.name
                        if name.startswith(".") and name.endswith(_TMP_SUFFIX):
                            # A write that never reached its rename: a crash or a kill.
                            try:
                                os.unlink(entry.path)
                                self._counters["temp_files_removed"] += 1
                            except FileNotFoundError:
                                pass
                            continue
                        if not _is_digest_name(name) or not name.startswith(shard.name):
                            continue
                        if not entry.is_file(follow_symlinks=False):
                            continue  # a symlink, FIFO or device under an entry's name: never indexed
                        st = entry.stat(follow_symlinks=False)
                        found.append((max(st.st_atime, st.st_mtime), name, st.st_size))
        return found

    # -- file I/O (worker threads) -----------------------------------------

    def _read_files(self, wanted: dict[str, str]) -> dict[str, bytes | str]:
        """Each digest's payload (``wanted``: digest -> key), or why not: ``"misses"``, ``"corrupt"``,
        ``"read_errors"``. A payload written for another key (a file renamed or planted) is corrupt."""
        found: dict[str, bytes | str] = {}
        now = time.time()
        for digest, key in wanted.items():
            path = self._path(digest)
            blob = self._read_entry(path, self._index.get(digest, 0), now)
            if isinstance(blob, str):
                found[digest] = blob
                continue
            if not verify_payload(blob, key):
                logger.warning("disk tier %r: corrupt payload in %s removed", self.name, path)
                self._unlink(path)
                found[digest] = "corrupt"
                continue
            found[digest] = blob
        return found

    def _read_entry(self, path: Path, size: int, now: float) -> bytes | str:
        """The bytes of the regular file of this user at ``path``, of exactly ``size`` bytes; else why not."""
        try:
            fd = os.open(path, _READ_FLAGS)
        except FileNotFoundError:
            return "misses"  # removed behind our back
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a symlink planted under an entry's name
                logger.warning("disk tier %r: %s is a symbolic link, not followed; removed", self.name, path)
                self._unlink(path)
                return "corrupt"
            logger.debug("disk tier %r: cannot read %s: %s", self.name, path, exc)
            return "read_errors"
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_size != size:
                logger.warning("disk tier %r: %s is not this user's regular file of the %d B indexed (mode %o, "
                               "uid %d, %d B); removed", self.name, path, size, info.st_mode, info.st_uid,
                               info.st_size)
                self._unlink(path)
                return "corrupt"
            parts, left = [], size
            while left:  # never more than the index says, whatever the file grows to meanwhile
                part = os.read(fd, min(left, 1 << 24))
                if not part:
                    break
                parts.append(part)
                left -= len(part)
            try:
                os.utime(fd, (now, now))  # recency survives a restart through the file's times
            except OSError:
                pass
            return b"".join(parts)
        except OSError as exc:
            logger.debug("disk tier %r: cannot read %s: %s", self.name, path, exc)
            return "read_errors"
        finally:
            os.close(fd)

    def _write_files(self, plan: list[tuple[str, bytes]], victims: list[str]) -> list[str]:
        self._remove_files(victims)
        return [self._write_file(digest, payload) for digest, payload in plan]

    def _write_file(self, digest: str, payload: bytes) -> str:
        """``"stored"``, ``"no_space"`` (the filesystem or quota is full) or ``"failed"``."""
        outcome = self._write_file_once(digest, payload)
        if outcome == "gone":  # the folder was removed behind our back (an operator, a cleaner): make it again
            outcome = self._write_file_once(digest, payload)
        return "failed" if outcome == "gone" else outcome

    def _write_file_once(self, digest: str, payload: bytes) -> str:
        """As ``_write_file``, or ``"gone"`` when a shard folder made earlier no longer exists."""
        shard = digest[:2]
        folder = self.root / shard
        final = self._path(digest)
        temp = folder / f".{digest}.{os.getpid()}.{secrets.token_hex(4)}{_TMP_SUFFIX}"
        try:
            if shard not in self._made_shards:
                for made in (self.root, folder):  # the root too: removed behind our back, it is made again
                    try:
                        os.mkdir(made, _PRIVATE_FOLDER)
                    except FileExistsError:
                        pass
                self._made_shards.add(shard)
            with os.fdopen(os.open(temp, _WRITE_FLAGS, _PRIVATE_FILE), "wb") as file:
                file.write(payload)
                if self.config.fsync:
                    file.flush()
                    os.fsync(file.fileno())
            os.replace(temp, final)
            if self.config.fsync:
                self._fsync_folder(folder)
        except OSError as exc:
            logger.debug("disk tier %r: cannot write %s: %s", self.name, final, exc)
            self._unlink(temp)
            if exc.errno in (errno.ENOENT, errno.ENOTDIR) and shard in self._made_shards:
                self._made_shards.discard(shard)  # the folder went away; recreate it
                return "gone"
            return "no_space" if exc.errno in _NO_SPACE else "failed"
        return "stored"

    def _remove_files(self, digests: list[str]) -> None:
        for digest in digests:
            self._unlink(self._path(digest))
            if digest not in self._index and digest not in self._writing:
                self._owner.pop(digest, None)

    def _unlink(self, path: Path) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.debug("disk tier %r: cannot remove %s: %s", self.name, path, exc)

    @staticmethod
    def _fsync_folder(folder: Path) -> None:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
