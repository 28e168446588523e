"""The replicas' shared state in etcd (`coordinator.etcd`), through `aetcd` (asyncio, the full v3 API: leases,
watches; chosen over `etcd3-async-client`, which has no leases and installs a top-level `etcd` package).

Keys under `coordinator.etcd.prefix` (default `/tandem`):

- `instances/<id>`: the instance, its health and load as of its last heartbeat (JSON), attached to a lease of
  `instance_ttl_s` that the replica receiving the agent's heartbeats keeps alive: when no replica hears from the agent
  any more, etcd deletes the key and every replica drops the instance;
- `drained/<id>`: present while an operator has the instance drained (no lease: it survives restarts);
- `scheduler`: the `coordinator.scheduler` section in force (JSON). A replica that reloads it from its mesh file
  writes it here; every replica applies what is here (the latest change wins, also over a replica's own file);
- `quotas/<replica incarnation>`: that replica's use of each tenant's quota (JSON `{tenant: [requests, tokens,
  in_flight]}`, `coordinator/quotas.py`), on a lease of `instance_ttl_s` it keeps alive: the other replicas charge
  their copies of the buckets with it, and forget it when the replica dies.

Each replica loads the prefix at start and then watches it from the next revision, applying every change to its own
`InstanceTable` (`shared_state.apply_change`). Writes go through one background task (latest value per key wins),
so a gRPC handler never waits for etcd. While etcd is unreachable the replica keeps its last known state (instances
reported by other replicas are kept alive locally), retries, and on reconnect writes again what it owns and reloads
the prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable

import aetcd

from coordinator.instances import Health, InstanceInfo, InstanceTable
from coordinator.quotas import Use
from coordinator.shared_state import (
    DrainSet,
    InstanceGone,
    InstancePut,
    apply_change,
    decode_instance,
    encode_instance,
)
from tandem.engine_load import EngineLoad
from tandem.netaddr import split_host_port

log = logging.getLogger(__name__)

RETRY_S = 0.5


class EtcdState:
    """Registrations, heartbeats and drains shared through etcd."""

    def __init__(self, endpoint: str, prefix: str, ttl_s: float) -> None:
        host, port = split_host_port(endpoint)
        self.client = aetcd.Client(host=host, port=port, timeout=5)
        self.prefix = prefix.rstrip("/").encode()
        self.ttl = max(1, round(ttl_s))
        self.table: InstanceTable | None = None
        self.connected = False
        self.owned: dict[str, InstancePut] = {}  # instances whose agent reports to this replica
        self.drained: set[str] = set()
        self._leases: dict[bytes, int] = {}  # key (an instance's, this replica's quota use) -> etcd lease id
        self._pending: dict[bytes, tuple[str, object]] = {}  # key -> (op, payload), latest wins
        self._wake = asyncio.Event()
        self.on_scheduler: Callable[[dict], None] | None = None  # applies a scheduler section seen in etcd
        self.scheduler_seen: dict | None = (
            None  # the last section written or seen (so an echo is not reapplied)
        )
        self._tasks: list[asyncio.Task] = []
        #: Applies another replica's quota use (None: the replica is gone); `replica` names this one's own key.
        self.on_quotas: Callable[[str, dict[str, Use] | None], None] | None = None
        self.replica = ""
        self._quota_peers: set[str] = set()

    def _key(self, kind: str, instance_id: str) -> bytes:
        return self.prefix + f"/{kind}/{instance_id}".encode()

    # --- what the gRPC services report ----------------------------------------------------------------------

    def registered(self, info: InstanceInfo, verified: bool = True) -> None:
        self.owned[info.instance_id] = InstancePut(info, Health.HEALTHY, EngineLoad(), verified)
        self._queue(self._key("instances", info.instance_id), "put", info.instance_id)

    def verified(self, instance_id: str) -> None:
        put = self.owned.get(instance_id)
        if put is not None and not put.verified:
            self.owned[instance_id] = dataclasses.replace(put, verified=True)
            self._queue(self._key("instances", instance_id), "put", instance_id)

    def reported(self, instance_id: str, health: Health, load: EngineLoad) -> None:
        put = self.owned.get(instance_id)
        if put is None:
            return
        self.owned[instance_id] = InstancePut(put.info, health, load, put.verified)
        self._queue(self._key("instances", instance_id), "put", instance_id)

    def deregistered(self, instance_id: str) -> None:
        self.owned.pop(instance_id, None)
        self._queue(self._key("instances", instance_id), "delete", instance_id)

    def drain_set(self, instance_id: str, drained: bool) -> None:
        (self.drained.add if drained else self.drained.discard)(instance_id)
        self._queue(self._key("drained", instance_id), "drain" if drained else "delete", instance_id)

    def scheduler_set(self, section: dict) -> None:
        """This replica reloaded `coordinator.scheduler` from its file: every replica should use it."""
        if section != self.scheduler_seen:
            self.scheduler_seen = section
            self._queue(self.prefix + b"/scheduler", "scheduler", json.dumps(section, sort_keys=True))

    def quotas_set(self, share: dict[str, Use]) -> None:
        """This replica's quota use (`Quotas.share`), for the others."""
        self._queue(self._key("quotas", self.replica), "quotas", json.dumps(share, sort_keys=True))

    def _queue(self, key: bytes, op: str, payload: object) -> None:
        self._pending[key] = (op, payload)
        self._wake.set()

    # --- background ------------------------------------------------------------------------------------------

    async def start(self, table: InstanceTable) -> None:
        self.table = table
        self._tasks = [asyncio.create_task(self._write()), asyncio.create_task(self._follow())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        with contextlib.suppress(Exception):
            await self.client.close()

    async def _write(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                key, (op, payload) = next(iter(self._pending.items()))
                try:
                    await self._apply_write(key, op, str(payload))
                except Exception as exc:  # etcd down or slow: keep the write, retry
                    log.warning("etcd write failed, retrying", extra={"key": key.decode(), "error": str(exc)})
                    self._leases.clear()  # leases may have ended meanwhile: grant new ones
                    for iid in self.owned:  # and write back everything this replica owns
                        self._pending.setdefault(self._key("instances", iid), ("put", iid))
                    await asyncio.sleep(RETRY_S)
                    continue
                if self._pending.get(key) == (op, payload):
                    del self._pending[key]

    async def _apply_write(self, key: bytes, op: str, arg: str) -> None:
        """One queued write; `arg` is the instance id (put, delete, drain) or the section's JSON (scheduler)."""
        instance_id = arg
        if op == "delete":
            await self.client.delete(key)
            lease = self._leases.pop(key, None)
            if lease is not None:
                with contextlib.suppress(Exception):
                    await self.client.revoke_lease(lease)
        elif op == "drain":
            await self.client.put(key, b"1")
        elif op == "scheduler":
            await self.client.put(key, arg.encode())
        elif op == "quotas":
            await self.client.put(key, arg.encode(), lease=await self._lease(key))
        else:
            put = self.owned.get(instance_id)
            if put is None:
                return
            await self.client.put(key, encode_instance(put), lease=await self._lease(key))

    async def _lease(self, key: bytes) -> int:
        """The live lease of `key`, refreshed, or a new one."""
        lease = self._leases.get(key)
        if lease is not None:
            reply = await self.client.refresh_lease(lease)
            if reply is None or reply.TTL <= 0:  # ended while we were away
                lease = None
        if lease is None:
            lease = (await self.client.lease(self.ttl)).id
            self._leases[key] = lease
        return lease

    async def _follow(self) -> None:
        while True:
            try:
                await self._load_and_watch()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self.connected:
                    log.warning("etcd unreachable: serving the last known state", extra={"error": str(exc)})
                self.connected = False
                self._keep_known_alive()
                await asyncio.sleep(RETRY_S)

    def _keep_known_alive(self) -> None:
        """While etcd is away nobody tells this replica about other replicas' instances: keep them as they were."""
        assert self.table is not None
        for state in self.table.all():
            if state.info.instance_id not in self.owned:
                self.table.heartbeat(state.info.instance_id, state.health, state.load)

    async def _load_and_watch(self) -> None:
        assert self.table is not None
        snapshot = await self.client.get_prefix(self.prefix + b"/")
        puts: dict[str, InstancePut] = {}
        drained: set[str] = set()
        quotas: dict[str, bytes] = {}
        for kv in snapshot:
            kind, _, iid = kv.key[len(self.prefix) + 1 :].decode().partition("/")
            if kind == "scheduler":
                self._scheduler(kv.value)
            elif kind == "quotas":
                quotas[iid] = kv.value
            elif kind == "instances":
                with contextlib.suppress(ValueError):
                    puts[iid] = decode_instance(kv.value)
            elif kind == "drained":
                drained.add(iid)
        # Reconcile: what the store lacks is gone (unless this replica owns it and will write it back).
        for state in self.table.all():
            iid = state.info.instance_id
            if iid not in puts and iid not in self.owned:
                apply_change(self.table, InstanceGone(iid), self.drained)
        self.drained = drained | {i for i in self.drained if i in self.owned and i not in puts}
        for put in puts.values():
            apply_change(self.table, put, self.drained)
        for replica in self._quota_peers - set(quotas):
            self._quotas(replica, None)
        for replica, value in quotas.items():
            self._quotas(replica, value)
        if not self.connected:
            log.info("etcd connected", extra={"instances": len(puts), "drained": len(drained)})
        self.connected = True
        for iid in self.owned:  # after an outage: make sure the store has what this replica owns
            self._queue(self._key("instances", iid), "put", iid)
        watch = await self.client.watch_prefix(
            self.prefix + b"/", start_revision=snapshot.header.revision + 1
        )

        async def follow() -> None:
            async for event in watch:
                self._on_event(event)

        async def probe() -> None:  # a watch on a dead etcd may just stay silent: ask every second
            while True:
                await asyncio.sleep(1.0)
                async with asyncio.timeout(2.0):
                    await self.client.status()

        tasks = [asyncio.create_task(follow()), asyncio.create_task(probe())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # the error that ended it
        finally:
            for task in tasks:
                task.cancel()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await watch.cancel()
        raise ConnectionError("etcd watch ended")

    def _scheduler(self, value: bytes) -> None:
        try:
            section = json.loads(value)
        except ValueError:
            return
        if section != self.scheduler_seen:
            self.scheduler_seen = section
            if self.on_scheduler is not None:
                self.on_scheduler(section)

    def _quotas(self, replica: str, value: bytes | None) -> None:
        """Another replica's quota use changed (None: its key is gone)."""
        if replica == self.replica or self.on_quotas is None:
            return
        share = None
        if value is not None:
            try:
                share = {name: (int(r), int(t), int(f)) for name, (r, t, f) in json.loads(value).items()}
            except (ValueError, TypeError, AttributeError):
                log.warning("unreadable quota use in etcd, ignored", extra={"replica": replica})
                return
        (self._quota_peers.add if share is not None else self._quota_peers.discard)(replica)
        self.on_quotas(replica, share)

    def _on_event(self, event) -> None:
        assert self.table is not None
        kind, _, iid = event.kv.key[len(self.prefix) + 1 :].decode().partition("/")
        put = event.kind == "PUT"
        if kind == "scheduler":
            if put:
                self._scheduler(event.kv.value)
        elif kind == "quotas":
            self._quotas(iid, event.kv.value if put else None)
        elif kind == "instances":
            if put:
                with contextlib.suppress(ValueError):
                    apply_change(self.table, decode_instance(event.kv.value), self.drained)
            elif iid not in self.owned:
                apply_change(self.table, InstanceGone(iid), self.drained)
        elif kind == "drained":
            apply_change(self.table, DrainSet(iid, put), self.drained)
