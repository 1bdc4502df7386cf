# The proxy's production image: the product's wheel (proxy and dedup: no Spark, no lab) and
# its dependencies in a virtualenv on Debian's python3, run as a non-root user.
#
#   docker run -e DEDUP_PROXY_UPSTREAM=kafka:9092 -e DEDUP_PROXY_REDIS=redis://redis:6379/0 \
#       -e DEDUP_PROXY_ADVERTISED_HOST=proxy.example.com -p 9190-9195:9190-9195 \
#       kafka-dedup-proxy/proxy
#
# Configuration: /etc/dedup-proxy/proxy.toml (mount your own over it) < DEDUP_PROXY_*
# environment < flags after the image name. Built by deploy/containers/engine.sh from a
# context holding the repository's pyproject.toml, README.md, proxy/ and dedup/, and image/.
ARG BASE=kafka-dedup-proxy/base:bookworm

FROM ${BASE} AS python
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/*

FROM python AS build
# The package index and the CA bundle of the machine that builds (see engine.sh).
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_TRUSTED_HOST
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/dedup-proxy
COPY build-ca.crt /tmp/build-ca.crt
WORKDIR /src
# The dependencies in a layer of their own, read from pyproject.toml: a change of the source
# alone reuses it.
COPY pyproject.toml ./
RUN python3 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
        >/tmp/requirements.txt \
    && if [ -s /tmp/build-ca.crt ]; then export PIP_CERT=/tmp/build-ca.crt; fi \
    && /opt/dedup-proxy/bin/pip install -r /tmp/requirements.txt
COPY README.md ./
COPY proxy ./proxy
COPY dedup ./dedup
# The wheel engine.sh built with the Rust record scan, when it could; else built here
# (without it: no Rust toolchain in this image).
COPY wheels /wheels
RUN if [ -s /tmp/build-ca.crt ]; then export PIP_CERT=/tmp/build-ca.crt; fi \
    && if ! ls /wheels/*.whl >/dev/null 2>&1; then \
        /opt/dedup-proxy/bin/pip wheel --no-deps --wheel-dir /wheels . ; fi \
    && /opt/dedup-proxy/bin/pip install --no-deps /wheels/*.whl \
    && /opt/dedup-proxy/bin/pip check \
    && /opt/dedup-proxy/bin/pip uninstall --yes pip setuptools

FROM python
RUN groupadd --system --gid 10001 dedup-proxy \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin dedup-proxy
COPY --from=build /opt/dedup-proxy /opt/dedup-proxy
COPY image/proxy.toml /etc/dedup-proxy/proxy.toml
COPY image/healthcheck.py /opt/dedup-proxy/healthcheck.py
# The product starts, and its optional parts stay out.
RUN /opt/dedup-proxy/bin/dedup-proxy --help >/dev/null \
    && ! /opt/dedup-proxy/bin/python -c 'import pyspark' 2>/dev/null \
    && ! /opt/dedup-proxy/bin/python -c 'import deploy' 2>/dev/null
ENV PATH=/opt/dedup-proxy/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    DEDUP_PROXY_LOG_STREAM=stdout
# Numeric, so that Kubernetes' runAsNonRoot can check it.
USER 10001:10001
# Admin, bootstrap, and brokers 0-2 (a broker N is served on 9193 + N - node_id_offset).
EXPOSE 9190 9192 9193 9194 9195
HEALTHCHECK --interval=5s --timeout=4s --start-period=60s --retries=3 \
    CMD ["/opt/dedup-proxy/bin/python", "/opt/dedup-proxy/healthcheck.py"]
# SIGTERM: the proxy closes its listeners, sends every answer already owed (up to
# drain_timeout_s, 30 s), and exits 0. Give `docker stop -t` more than that.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/opt/dedup-proxy/bin/dedup-proxy", "serve", "--config", "/etc/dedup-proxy/proxy.toml"]
