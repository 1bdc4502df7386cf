"""The dedup part of the admin HTTP API (JSON), mounted on the proxy's admin port.

GET    /v1/topics/{topic}/partitions/{partition}/producers/{name}  last persisted sequence
GET    /v1/topics/{topic}/producers/{name}                         highest over partitions
GET    /v1/topics/{topic}/partitions/{partition}/producers         tracked producers
GET    /v1/policies                                                all policies
PUT    /v1/policies/global             {"mode": "enabled|require|disabled"}
DELETE /v1/policies/global
PUT    /v1/policies/prefixes/{prefix}  {"mode": ...}     DELETE removes it
PUT    /v1/policies/topics/{topic}     {"mode": ...}     DELETE removes it
POST   /v1/producer-names                                          a unique producer name
GET    /v1/snapshots              per partition this proxy writes: recovery, snapshot offset, age
POST   /v1/topics/{topic}/partitions/{partition}/snapshot          take a snapshot now
POST   /v1/topics/{topic}/partitions/{partition}/recover[?wait_s=N] recover from the log now
POST   /v1/topics/{topic}/partitions/{partition}/producers/{name}/reset  forget one producer
POST   /v1/topics/{topic}/producers/{name}/reset   ... on every partition this instance owns
GET    /v1/topics/{topic}/principals              producer name -> the principal it belongs to
DELETE /v1/topics/{topic}/principals/{name}       release a name (the next principal owns it)

A policy change that disables dedup for a topic clears that topic's dedup state.
"""

from __future__ import annotations

import json
from typing import Any

import structlog
from aiohttp import web
from redis.exceptions import RedisError

from dedup.chunks import ChunkProgress
from dedup.policies import Mode, PolicySnapshot
from dedup.service import DedupService
from dedup.snapshots import SnapshotError
from dedup.state import clock_ms

log = structlog.get_logger(__name__)

PRODUCER_NAME_COUNTER = "producer-names"
RECOVERY_WAIT_S = 60.0


def add_dedup_routes(app: web.Application, service: DedupService) -> None:
    state, policies = service.state, service.policies

    async def recovered(topic: str, partitions: list[int]) -> None:
        """State reads after a crash are true only once the partitions are recovered."""
        if (await policies.snapshot()).mode_for(topic) is Mode.DISABLED:
            return
        keys = [(topic, partition) for partition in partitions]
        try:
            ready = await service.engine.ensure_recovered(keys, RECOVERY_WAIT_S)
            current = ready and await service.copies_are_current(topic, partitions)
        except (OSError, TimeoutError) as exc:  # the topic's id could not be asked
            raise web.HTTPServiceUnavailable(
                text=f"{topic}: Kafka did not confirm the topic ({exc!r}); retry"
            ) from exc
        if not ready:
            raise web.HTTPServiceUnavailable(
                text=f"{topic} is still recovering its dedup state; retry"
            )
        if not current:
            raise web.HTTPServiceUnavailable(
                text=f"{topic} was deleted and created again: the instance that owns its "
                "partition has not rebuilt their dedup state yet (it does within "
                f"topic_id_check_s, {service.settings.topic_id_check_s:g} s); retry"
            )

    async def last_sequence(request: web.Request) -> web.Response:
        topic, partition, name = _topic(request), _partition(request), request.match_info["name"]
        await recovered(topic, [partition])
        await service.engine.flush_persisted()
        producers = await service.producers(topic, partition)
        found = producers.get(name)
        return web.json_response(
            {
                "topic": topic,
                "partition": partition,
                "producer": name,
                "last_sequence_id": await service.last_sequence(topic, partition, name),
                "pushed": None if found is None else found.pushed,
                "last_seen_ms": None if found is None else found.last_seen_ms,
            }
        )

    async def topic_last_sequence(request: web.Request) -> web.Response:
        topic, name = _topic(request), request.match_info["name"]
        partitions = await service.topic_partitions(topic)
        await recovered(topic, partitions)
        await service.engine.flush_persisted()
        per_partition = {
            partition: await service.last_sequence(topic, partition, name)
            for partition in sorted(set(partitions) | set(await state.partitions(topic)))
        }
        return web.json_response(
            {
                "topic": topic,
                "producer": name,
                "last_sequence_id": max(per_partition.values(), default=-1),
                "partitions": {str(p): s for p, s in sorted(per_partition.items())},
            }
        )

    async def producers(request: web.Request) -> web.Response:
        topic, partition = _topic(request), _partition(request)
        await service.engine.flush_persisted()
        tracked = await service.producers(topic, partition)
        return web.json_response(
            {
                "topic": topic,
                "partition": partition,
                "producers": {
                    name: {
                        "pushed": p.pushed,
                        "persisted": p.persisted,
                        "last_seen_ms": p.last_seen_ms,
                        # A chunked message in progress (its sequence is not persisted yet).
                        "pushed_chunk": _chunk_json(p.pushed_chunk),
                        "persisted_chunk": _chunk_json(p.persisted_chunk),
                    }
                    for name, p in sorted(tracked.items())
                },
            }
        )

    async def read_policies(_: web.Request) -> web.Response:
        return web.json_response((await policies.snapshot(fresh=True)).to_json())

    async def set_policy(request: web.Request) -> web.Response:
        kind = request.match_info.get("kind", "global")
        name = request.match_info.get("name", "")
        mode = None if request.method == "DELETE" else await _mode(request)
        before = await policies.snapshot(fresh=True)
        if kind == "global":
            await policies.set_global(mode)
        elif kind == "prefixes":
            await policies.set_prefix(name, mode)
        elif kind == "topics":
            await policies.set_topic(name, mode)
        else:
            raise web.HTTPNotFound(text=f"no policy kind {kind!r}")
        after = await policies.snapshot(fresh=True)
        cleared = await _clear_newly_disabled(service, before, after)
        return web.json_response({**after.to_json(), "cleared_topics": cleared})

    async def new_producer_name(_: web.Request) -> web.Response:
        key = f"{service.settings.redis_key_prefix}:{PRODUCER_NAME_COUNTER}"
        number = await service.redis.incr(key)
        return web.json_response({"producer_name": f"dedup-proxy-{number}"})

    async def list_snapshots(_: web.Request) -> web.Response:
        now = clock_ms()
        partitions = []
        failing = service.recoveries.failing()
        for (topic, partition), p in sorted(service.engine.partition_states().items()):
            partitions.append(
                {
                    "topic": topic,
                    "partition": partition,
                    "recovered": p.recovered,
                    "snapshot_offset": p.snapshot_offset,
                    "snapshot_age_s": None
                    if p.snapshot_ms is None
                    else round((now - p.snapshot_ms) / 1000, 3),
                    "next_generation": p.snapshot_generation,
                    "acknowledged_end": p.cursor.safe_end,
                    "writes_unsettled": p.cursor.unsettled,
                    "records_since_snapshot": p.cursor.records_settled - p.snapshot_records,
                    # Set while its recovery keeps failing (it is retried with a backoff of
                    # its own; the other partitions are not held back).
                    "recovery_failing": failing.get((topic, partition)),
                }
            )
        return web.json_response(
            {"snapshot_topic": service.settings.snapshot_topic, "partitions": partitions}
        )

    async def snapshot_now(request: web.Request) -> web.Response:
        topic, partition = _topic(request), _partition(request)
        try:
            snapshot = await service.snapshotter.snapshot_now((topic, partition))
        except (SnapshotError, RedisError, OSError) as exc:
            raise web.HTTPServiceUnavailable(
                text=f"snapshot of {topic}/{partition} failed: {type(exc).__name__}: {exc}"
            ) from None
        if snapshot is None:
            raise web.HTTPConflict(
                text=f"{topic}/{partition} is not recovered by this proxy (never written "
                "through it, or recovering): nothing to snapshot"
            )
        return web.json_response(
            {
                "topic": topic,
                "partition": partition,
                "offset": snapshot.offset,
                "generation": snapshot.generation,
                "producers": len(snapshot.producers),
            }
        )

    async def recover_now(request: web.Request) -> web.Response:
        topic, partition = _topic(request), _partition(request)
        try:
            wait_s = float(request.query.get("wait_s", "120"))
        except ValueError:
            raise web.HTTPBadRequest(text="wait_s must be a number of seconds") from None
        service.engine.request_recovery([(topic, partition)], "operator request")
        if not await service.engine.wait_recovered([(topic, partition)], wait_s):
            raise web.HTTPGatewayTimeout(
                text=f"{topic}/{partition} is still recovering after {wait_s} s; see the logs"
            )
        state = service.engine.partition_states()[(topic, partition)]
        return web.json_response(
            {
                "topic": topic,
                "partition": partition,
                "recovered": True,
                "end": state.cursor.safe_end,
                "snapshot_offset": state.snapshot_offset,
            }
        )

    base = "/v1/topics/{topic}"

    async def ownership(_: web.Request) -> web.Response:
        """This instance, the live members as it sees them, and the partitions it holds."""
        owner = service.ownership
        return web.json_response(
            {
                "instance": owner.me.instance_id,
                "placement": owner.placement,
                "members": [
                    {
                        "instance": m.instance_id,
                        "slot": m.slot,
                        "host": m.host,
                        "port_base": m.port_base,
                        "local_broker_id": m.local_broker_id,
                        "sni_host_pattern": m.sni_host_pattern,
                    }
                    for m in owner.members
                ],
                "held": sorted(f"{t}/{p}" for t, p in owner.held),
                "handing_off": sorted(f"{t}/{p}" for t, p in owner.handing_off),
            }
        )

    async def reset_producer(request: web.Request) -> web.Response:
        topic, partition, name = _topic(request), _partition(request), request.match_info["name"]
        try:
            offset = await service.reset_producer(topic, partition, name)
        except (SnapshotError, RedisError, OSError, TimeoutError) as exc:
            raise web.HTTPServiceUnavailable(
                text=f"reset of {name} on {topic}/{partition} failed: {type(exc).__name__}: {exc}"
            ) from None
        if offset is None:
            raise web.HTTPConflict(
                text=f"{topic}/{partition} is not recovered by this proxy (another instance "
                "owns it, or it was never written through it): reset it where it is owned"
            )
        return web.json_response(
            {"topic": topic, "partition": partition, "producer": name, "offset": offset}
        )

    async def reset_producer_on_topic(request: web.Request) -> web.Response:
        topic, name = _topic(request), request.match_info["name"]
        partitions = await service.topic_partitions(topic)
        if not partitions:
            raise web.HTTPNotFound(text=f"no topic {topic} in Kafka")
        reset: dict[str, int] = {}
        elsewhere: list[int] = []
        for partition in partitions:
            try:
                offset = await service.reset_producer(topic, partition, name)
            except (SnapshotError, RedisError, OSError, TimeoutError) as exc:
                raise web.HTTPServiceUnavailable(
                    text=f"reset of {name} on {topic}/{partition} failed (partitions reset "
                    f"before it: {sorted(reset)}): {type(exc).__name__}: {exc}"
                ) from None
            if offset is None:
                elsewhere.append(partition)
            else:
                reset[str(partition)] = offset
        # Partitions recovered by other instances are theirs to reset (ask each of them).
        return web.json_response(
            {"topic": topic, "producer": name, "reset": reset, "not_owned_here": elsewhere}
        )

    async def principals(request: web.Request) -> web.Response:
        topic = _topic(request)
        return web.json_response(
            {"topic": topic, "principals": await service.bindings.owners(topic)}
        )

    async def release_principal(request: web.Request) -> web.Response:
        topic, name = _topic(request), request.match_info["name"]
        released = await service.bindings.release(topic, name)
        log.info("producer name released", topic=topic, producer=name, was_bound=released)
        return web.json_response({"topic": topic, "producer": name, "released": released})

    app.router.add_get("/v1/ownership", ownership)
    app.router.add_get(base + "/principals", principals)
    app.router.add_post(base + "/partitions/{partition}/producers/{name}/reset", reset_producer)
    app.router.add_post(base + "/producers/{name}/reset", reset_producer_on_topic)
    app.router.add_delete(base + "/principals/{name}", release_principal)
    app.router.add_get(base + "/partitions/{partition}/producers/{name}", last_sequence)
    app.router.add_get(base + "/producers/{name}", topic_last_sequence)
    app.router.add_get(base + "/partitions/{partition}/producers", producers)
    app.router.add_get("/v1/policies", read_policies)
    for method in ("PUT", "DELETE"):
        app.router.add_route(method, "/v1/policies/global", set_policy)
        app.router.add_route(method, "/v1/policies/{kind}/{name}", set_policy)
    app.router.add_post("/v1/producer-names", new_producer_name)
    app.router.add_get("/v1/snapshots", list_snapshots)
    app.router.add_post(base + "/partitions/{partition}/snapshot", snapshot_now)
    app.router.add_post(base + "/partitions/{partition}/recover", recover_now)


async def _clear_newly_disabled(
    service: DedupService, before: PolicySnapshot, after: PolicySnapshot
) -> list[str]:
    """Disabling clears the maps (Pulsar does the same): stale state must not outlive it."""
    cleared = []
    for topic in await service.state.topics():
        if after.mode_for(topic) is Mode.DISABLED and before.mode_for(topic) is not Mode.DISABLED:
            service.engine.forget_topic(topic)
            await service.state.clear(topic)
            cleared.append(topic)
    return sorted(cleared)


def _topic(request: web.Request) -> str:
    topic = request.match_info["topic"]
    if not topic:
        raise web.HTTPBadRequest(text="empty topic name")
    return topic


def _partition(request: web.Request) -> int:
    raw = request.match_info["partition"]
    if not (raw.isascii() and raw.isdigit()):  # str.isdigit alone takes "²"
        raise web.HTTPBadRequest(text=f"partition must be a non-negative integer, got {raw!r}")
    return int(raw)


async def _mode(request: web.Request) -> Mode:
    try:
        body: Any = await request.json()
        return Mode(body["mode"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        modes = ", ".join(m.value for m in Mode)
        raise web.HTTPBadRequest(text=f'expected JSON {{"mode": one of {modes}}}') from None


def _chunk_json(progress: ChunkProgress | None) -> dict[str, Any] | None:
    if progress is None:
        return None
    return {
        "sequence": progress.sequence,
        "uuid": progress.uuid,
        "chunk_id": progress.chunk_id,
        "chunk_count": progress.chunk_count,
        "total_size": progress.total_size,
        "size": progress.size,
    }
