# The Toxiproxy server deploy/setup.sh builds from the Go module proxy (a static binary).
ARG BASE=kafka-dedup-proxy/base:bookworm
FROM ${BASE}

COPY toxiproxy-server /usr/local/bin/toxiproxy-server
RUN groupadd --system --gid 10003 toxiproxy \
    && useradd --system --uid 10003 --gid 10003 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin toxiproxy
USER 10003:10003
EXPOSE 8474
ENTRYPOINT ["/usr/local/bin/toxiproxy-server", "-host", "0.0.0.0", "-port", "8474"]
