# Apache Kafka in KRaft mode, from the jars deploy/setup.sh resolves from Maven Central (the
# version pinned in deploy/kafka/pom.xml) on a Debian base with its Java 17 runtime.
# Configured by the environment: see kafka/entrypoint.sh. Built by deploy/containers/engine.sh.
ARG BASE=kafka-dedup-proxy/base:bookworm
FROM ${BASE}

RUN apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10002 kafka \
    && useradd --system --uid 10002 --gid 10002 --home-dir /var/lib/kafka \
        --shell /usr/sbin/nologin kafka \
    && mkdir -p /var/lib/kafka/data /opt/kafka/config \
    && chown -R kafka:kafka /var/lib/kafka /opt/kafka/config

COPY libs/ /opt/kafka/libs/
COPY image/log4j2.properties /opt/kafka/log4j2.properties
COPY image/entrypoint.sh /opt/kafka/entrypoint.sh

USER 10002:10002
WORKDIR /var/lib/kafka
VOLUME /var/lib/kafka/data
EXPOSE 9092 9093
# Ready once the client listener accepts: the broker opens it when it has joined the cluster.
# Failures count only after the start period, which a loaded machine may need for a quorum.
HEALTHCHECK --interval=5s --timeout=3s --start-period=180s --retries=3 \
    CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/${KAFKA_HEALTH_PORT:-9092}"]
ENTRYPOINT ["/opt/kafka/entrypoint.sh"]
