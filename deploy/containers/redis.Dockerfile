# Redis, Debian's package, for the dedup state. Append-only file in /var/lib/redis.
ARG BASE=kafka-dedup-proxy/base:bookworm
FROM ${BASE}

# The package's own user, created first with a fixed id (its postinst keeps an existing one).
RUN groupadd --system --gid 10004 redis \
    && useradd --system --uid 10004 --gid 10004 --home-dir /var/lib/redis \
        --shell /usr/sbin/nologin redis \
    && apt-get update \
    && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/*
COPY image/redis.conf /etc/redis/container.conf

USER 10004:10004
WORKDIR /var/lib/redis
VOLUME /var/lib/redis
EXPOSE 6379
HEALTHCHECK --interval=5s --timeout=3s --start-period=10s --retries=3 \
    CMD ["redis-cli", "ping"]
ENTRYPOINT ["redis-server", "/etc/redis/container.conf"]
