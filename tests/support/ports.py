"""Every fixed port the tests use, in one place, so no two of them collide.

All are away from the defaults (so a proxy or environment run by hand stays usable) and
below Linux's ephemeral range, 32768+ (so an outgoing connection cannot be holding them).
Integration sessions run one at a time (they share these ports and the local environment).
tests/unit/test_fixed_ports.py checks that no two of them, counted with every port they
imply (a Redis cluster's bus ports, a proxy's per-broker listeners...), collide.
"""

from __future__ import annotations

from dataclasses import dataclass

from deploy.config import Ports
from deploy.spark_cluster import ClusterPorts


@dataclass(frozen=True)
class ProxyPorts:
    """A proxy's client listener, admin API and first per-broker listener."""

    listen: int
    admin: int
    broker_base: int


# --- proxies in front of the session's local environment ------------------------------------

PASSTHROUGH = ProxyPorts(listen=28292, admin=28280, broker_base=28293)  # conftest `proxy`
DEDUP = ProxyPorts(listen=28692, admin=28680, broker_base=28693)  # conftest `dedup_proxy`
SHUTDOWN = ProxyPorts(listen=28392, admin=28380, broker_base=28393)  # test_faults
RELAYED = ProxyPorts(listen=28792, admin=28780, broker_base=28793)  # test_dedup, behind RELAY_*
IDLE_PURGE = ProxyPorts(listen=28992, admin=28980, broker_base=28993)  # test_dedup
RECOVERY = ProxyPorts(listen=27092, admin=27080, broker_base=27093)  # test_recovery
CHUNKS = ProxyPorts(listen=29192, admin=29180, broker_base=29193)  # test_chunks
# test_instances: several instances sharing one Redis key prefix.
INSTANCES = [
    ProxyPorts(listen=25092 + 100 * i, admin=25080 + 100 * i, broker_base=25093 + 100 * i)
    for i in range(3)
]
# test_pass_through: a proxy assembled without dedup.
PASS_THROUGH_ONLY = ProxyPorts(listen=29392, admin=29380, broker_base=29393)
# test_admin_auth: a dedup proxy whose admin API needs bearer tokens.
ADMIN_AUTH = ProxyPorts(listen=29792, admin=29780, broker_base=29793)
# test_tls: a dedup proxy with TLS on its listeners and admin API, and toward Kafka.
TLS = ProxyPorts(listen=29992, admin=29980, broker_base=29993)
SASL = ProxyPorts(listen=26892, admin=26880, broker_base=26893)  # test_tls, SASL_SSL upstream
OAUTH = ProxyPorts(listen=26592, admin=26580, broker_base=26593)  # test_tls, OAUTHBEARER
OAUTH_FILE = ProxyPorts(listen=27992, admin=27980, broker_base=27993)  # test_tls, token file
CERT_RELOAD = ProxyPorts(listen=26792, admin=26780, broker_base=26793)  # test_tls, SIGHUP
# test_sni: one TLS port for the bootstrap and every broker (broker_base is not listened on).
SNI = ProxyPorts(listen=27892, admin=27880, broker_base=27893)
# test_sni: two instances, each routing names of its own.
SNI_GROUP = [
    ProxyPorts(listen=27792, admin=27780, broker_base=27793),
    ProxyPorts(listen=27692, admin=27680, broker_base=27693),
]
TLS_REDIS = 17099  # test_tls: a Redis that speaks TLS only, with client certificates
# test_hostile_input: a dedup proxy whose Redis is behind REDIS_RELAY (the acks=0 flood).
FLOOD = ProxyPorts(listen=29692, admin=29680, broker_base=29693)
# test_hostile_input: a dedup proxy with max_sequence_jump.
JUMP_BOUND = ProxyPorts(listen=29892, admin=29880, broker_base=29893)
# test_dedup: a dedup proxy that checks in Redis (check_state redis).
REDIS_CHECK = ProxyPorts(listen=29492, admin=29480, broker_base=29493)

# test_workers: `serve --workers 2`; worker i serves admin + i and brokers at
# broker_base + 100 * i (27293, 27393).
WORKERS = ProxyPorts(listen=27292, admin=27280, broker_base=27293)
# test_local_proxies: `local up --proxies 2` in an environment of its own (LOCAL_PROXIES_ENV
# below); proxy i (1, 2) listens on 23492 + 100 * (i - 1), admin 12 below, brokers from
# listen + 1.
LOCAL_PROXY_BASE = 23492

# The relay that cuts connections (test_dedup): clients reach RELAYED only through it.
RELAY_BOOTSTRAP = 28892
RELAY_BROKER_BASE = 28893

# --- environments of their own ----------------------------------------------------------------

# test_cluster: three brokers, and the proxy in front of them.
CLUSTER_ENV = Ports(kafka_base=20092, redis=16479)
CLUSTER_PROXY = ProxyPorts(listen=28492, admin=28480, broker_base=28493)
# test_cluster: a sidecar instance beside each of the three brokers.
CLUSTER_SIDECARS = [
    ProxyPorts(listen=30092 + 100 * i, admin=30080 + 100 * i, broker_base=30093 + 100 * i)
    for i in range(3)
]

# test_local_env: three brokers and Redis, beside the session's environment.
THREE_NODE_ENV = Ports(kafka_base=22092, redis=16499)

# test_batches_interop: one broker and Redis.
BATCHES_ENV = Ports(kafka_base=21092, redis=16779)

# test_local_proxies: one broker, Redis and two proxies.
LOCAL_PROXIES_ENV = Ports(kafka_base=21592, redis=16579, proxy_base=LOCAL_PROXY_BASE)

# test_secured_env: `local up --security sasl_ssl --proxies 1`: one broker (SASL_SSL on
# 21792, controller 21892), Redis over TLS on 16589, proxy-1 on 23792 (admin 23780).
SECURED_ENV = Ports(kafka_base=21792, redis=16589, proxy_base=23792)
# test_secured_env: a proxy of the test's own in front of that environment
SECURED_OWN = ProxyPorts(listen=23692, admin=23680, broker_base=23693)

# test_secured_cluster: `local up --brokers 3 --security sasl_ssl`, with two proxies in
# balanced placement or three in sidecar placement (proxy i on 23192 + 100 * (i - 1)).
SECURED_CLUSTER_ENV = Ports(kafka_base=21392, redis=16599, proxy_base=23192)

# test_dedup_state: a bare redis-server, and one a test stops.
DEDUP_STATE_REDIS = 16679
POLICY_OUTAGE_REDIS = 16689

# test_recovery: a relay in front of the local Redis that the test can blackhole.
REDIS_RELAY = 16699

# test_redis_topologies: Redis with Sentinel (data nodes 16879-16881, Sentinels 16889-16891),
# a Redis Cluster (nodes 16979-16984, cluster bus 26979-26984), and the proxy using either.
SENTINEL_REDIS = 16879
CLUSTER_REDIS = 16979
# ... and the same over TLS only: Sentinel data nodes 17179-17181, Sentinels 17189-17191; a
# cluster on 17479-17484 (bus 27479-27484).
TLS_SENTINEL_REDIS = 17179
TLS_CLUSTER_REDIS = 17479
REDIS_TOPOLOGY_PROXY = ProxyPorts(listen=29592, admin=29580, broker_base=29593)

# test_toxiproxy: the broker listens on 24192 (replication 24242, controller 24292) and
# advertises 24200, where a Toxiproxy link forwards to it; a TCP echo server sits behind a
# second link.
TOXIPROXY_KAFKA_BASE = 24192
TOXIPROXY_ADVERTISED_BASE = 24200
TOXIPROXY_REDIS = 17379
TOXIPROXY_API = 24474
TOXIPROXY_ECHO_UPSTREAM = 24210
TOXIPROXY_ECHO_LISTEN = 24211
TOXIPROXY_ENV = Ports(
    kafka_base=TOXIPROXY_KAFKA_BASE,
    redis=TOXIPROXY_REDIS,
    advertised_kafka_base=TOXIPROXY_ADVERTISED_BASE,
)
# ... and a dedup proxy in front of it, killed and started again.
TOXIPROXY_DEDUP = ProxyPorts(listen=24392, admin=24380, broker_base=24393)
# ... and a group of two instances in front of it, its owner killed.
TOXIPROXY_GROUP = [
    ProxyPorts(listen=24592 + 100 * i, admin=24580 + 100 * i, broker_base=24593 + 100 * i)
    for i in range(2)
]

# test_spark_cluster: a standalone Spark master (31700, status UI 31701) and its workers
# (31710+i, UIs 31720+i); executors and the driver take ports of the kernel's choosing.
SPARK_CLUSTER = ClusterPorts(base=31700)
