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

A policy change that disables dedup for a topic clears that topic's dedup state.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from dedup.policies import Mode, PolicySnapshot
from dedup.service import DedupService

PRODUCER_NAME_COUNTER = "producer-names"


def add_dedup_routes(app: web.Application, service: DedupService) -> None:
    state, policies = service.state, service.policies

    async def last_sequence(request: web.Request) -> web.Response:
        topic, partition, name = _topic(request), _partition(request), request.match_info["name"]
        await service.engine.flush_persisted()
        producers = await state.producers(topic, partition)
        found = producers.get(name)
        return web.json_response(
            {
                "topic": topic,
                "partition": partition,
                "producer": name,
                "last_sequence_id": await state.last_sequence(topic, partition, name),
                "pushed": None if found is None else found.pushed,
                "last_seen_ms": None if found is None else found.last_seen_ms,
            }
        )

    async def topic_last_sequence(request: web.Request) -> web.Response:
        topic, name = _topic(request), request.match_info["name"]
        await service.engine.flush_persisted()
        per_partition = {
            partition: await state.last_sequence(topic, partition, name)
            for partition in await state.partitions(topic)
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
        tracked = await state.producers(topic, partition)
        return web.json_response(
            {
                "topic": topic,
                "partition": partition,
                "producers": {
                    name: {
                        "pushed": p.pushed,
                        "persisted": p.persisted,
                        "last_seen_ms": p.last_seen_ms,
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

    base = "/v1/topics/{topic}"
    app.router.add_get(base + "/partitions/{partition}/producers/{name}", last_sequence)
    app.router.add_get(base + "/producers/{name}", topic_last_sequence)
    app.router.add_get(base + "/partitions/{partition}/producers", producers)
    app.router.add_get("/v1/policies", read_policies)
    for method in ("PUT", "DELETE"):
        app.router.add_route(method, "/v1/policies/global", set_policy)
        app.router.add_route(method, "/v1/policies/{kind}/{name}", set_policy)
    app.router.add_post("/v1/producer-names", new_producer_name)


async def _clear_newly_disabled(
    service: DedupService, before: PolicySnapshot, after: PolicySnapshot
) -> list[str]:
    """Disabling clears the maps (Pulsar does the same): stale state must not outlive it."""
    cleared = []
    for topic in await service.state.topics():
        if after.mode_for(topic) is Mode.DISABLED and before.mode_for(topic) is not Mode.DISABLED:
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
    if not raw.isdigit():
        raise web.HTTPBadRequest(text=f"partition must be a non-negative integer, got {raw!r}")
    return int(raw)


async def _mode(request: web.Request) -> Mode:
    try:
        body: Any = await request.json()
        return Mode(body["mode"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        modes = ", ".join(m.value for m in Mode)
        raise web.HTTPBadRequest(text=f'expected JSON {{"mode": one of {modes}}}') from None
