"""The composition root: a proxy assembled from settings, with dedup plugged in or not.

Nothing below this module knows how the pieces fit: the runtime gets a filter chain and
services, dedup gets what it needs of the upstream cluster, and the admin port gets the
routes of whatever was plugged in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import structlog

from dedup.admin_api import add_dedup_routes
from dedup.app.settings import Settings
from dedup.batches import use_native_scan
from dedup.ownership.filters import ownership_filters
from dedup.produce_filter import DedupProduceFilter
from dedup.service import DedupService, UpstreamAccess
from proxy.filters import standard_filters
from proxy.runtime.admin import AdminRoutes
from proxy.runtime.chain import FilterChain
from proxy.runtime.cluster import UpstreamCluster
from proxy.runtime.server import ProxyServer, topology_of

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class AssembledProxy:
    server: ProxyServer
    admin_routes: list[AdminRoutes] = field(default_factory=list)
    dedup: DedupService | None = None  # None: a plain Kafka proxy (pass-through)


def assemble(settings: Settings) -> AssembledProxy:
    topology = topology_of(settings)
    sni = topology.sni
    security = settings.upstream_security
    cluster = UpstreamCluster(topology, settings.upstream_connect_timeout_s, security.link())
    filters = standard_filters()
    if settings.pass_through:
        return AssembledProxy(ProxyServer(settings, cluster, FilterChain(filters)))
    if not use_native_scan(settings.native_record_scan) and settings.native_record_scan:
        log.warning(
            "the Rust record scan (dedup._records) is not built: every batch is read record "
            "by record in Python, several times slower; build it with a Rust toolchain "
            "(deploy/setup.sh, or pip install with cargo on the PATH)"
        )
    elif not settings.native_record_scan:
        log.info("the Rust record scan is switched off (native_record_scan): Python readers")
    dedup = DedupService(
        settings,
        UpstreamAccess(
            bootstrap_servers=list(settings.upstream),
            security=security,
            instance_id=settings.effective_instance_id,
            connect_timeout_s=settings.upstream_connect_timeout_s,
            known_upstreams=cluster.known_upstreams,
            leader_of=cluster.leader_of,
            partition_leader=cluster.partition_leader,
            advertised_host=topology.advertised_host,
            advertised_port_base=sni.advertised_port if sni else topology.advertised_port_base,
            node_id_offset=topology.node_id_offset,
            sni_host_pattern=sni.broker_host_pattern if sni else None,
        ),
    )
    # The ownership filters go first: response filters run in reverse, so they see the
    # runtime's rewritten answers and name every instance's nodes.
    chain = FilterChain(
        [
            *ownership_filters(dedup.ownership, dedup.policies),
            *filters,
            DedupProduceFilter(
                dedup.engine,
                settings.clients_numbering_from_base,
                write_permission_ttl_s=settings.write_permission_ttl_s,
            ),
        ]
    )
    server = ProxyServer(settings, cluster, chain, services=[dedup])
    return AssembledProxy(server, [partial(add_dedup_routes, service=dedup)], dedup)
