#!/usr/bin/env bash
# The container engine and the project's images.
#
#   engine.sh [up]     an engine that answers (started here if none does), then the images
#   engine.sh images   the images only, on the engine that answers
#   engine.sh host     print the DOCKER_HOST of the engine that answers
#   engine.sh stop     stop the engine this script started (never one it found)
#
# The engine is the first that answers of: $DOCKER_HOST, /var/run/docker.sock, and the one
# this script runs. Where none answers, Debian's docker.io is installed and dockerd started
# with all its state under the state home ($DEDUP_DOCKER_HOME, else
# ${XDG_STATE_HOME:-~/.local/state}/kafka-dedup-proxy/docker): data/, exec/, docker.sock,
# dockerd.pid, dockerd.log. It keeps running after this script, like the local Kafka.
#
# The images are built locally, from nothing any registry serves: a Debian base made with
# debootstrap, Debian's packages, the Kafka jars and the Toxiproxy binary that
# deploy/setup.sh put in the cache, and the product's source. Each image carries the hash
# of its inputs (label org.kafka-dedup-proxy.inputs) and is rebuilt only when it changed.
#
# Exit status 3: containers cannot run on this machine (the last line says why); tests that
# need them are skipped with that reason. Any other failure is an error.
set -euo pipefail

say() { printf 'engine: %s\n' "$*" >&2; }
die() { printf 'engine: error: %s\n' "$*" >&2; exit 1; }
unavailable() { printf 'engine: unavailable: %s\n' "$*" >&2; exit 3; }

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HERE="$ROOT/deploy/containers"
LIB_TAG=engine
# shellcheck source=../lib.sh
source "$ROOT/deploy/lib.sh"
# shellcheck source=../versions.env
source "$ROOT/deploy/versions.env"
KAFKA_VERSION="$(pom_property "$ROOT/deploy/kafka/pom.xml" kafka.version)"
PRODUCT_VERSION="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$ROOT/pyproject.toml" | head -n1)"
SUITE="${CONTAINER_DEBIAN_SUITE:?deploy/versions.env sets no CONTAINER_DEBIAN_SUITE}"
[ -n "$KAFKA_VERSION" ] && [ -n "$PRODUCT_VERSION" ] || die "cannot read the pinned versions"

CACHE_HOME="$(xdg_dir "${XDG_CACHE_HOME:-}" "$HOME/.cache")"
STATE_BASE="$(xdg_dir "${XDG_STATE_HOME:-}" "$HOME/.local/state")"
HOME_DIR="${DEDUP_DOCKER_HOME:-$STATE_BASE/kafka-dedup-proxy/docker}"
SOCKET="$HOME_DIR/docker.sock"
PID_FILE="$HOME_DIR/dockerd.pid"
LOG="$HOME_DIR/dockerd.log"
KAFKA_LIBS="$CACHE_HOME/kafka-dedup-proxy/kafka-$KAFKA_VERSION/libs"
TOXIPROXY_BIN="$CACHE_HOME/kafka-dedup-proxy/toxiproxy-$TOXIPROXY_VERSION/toxiproxy-server"

REPO=kafka-dedup-proxy
LABEL=org.kafka-dedup-proxy.inputs
BASE_IMAGE="$REPO/base:$SUITE"

as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        sudo -n "$@"
    else
        return 126
    fi
}

APT_UPDATED=0
apt_install() {
    command -v apt-get >/dev/null 2>&1 || unavailable "no apt-get to install $* with"
    as_root true || unavailable "installing $* needs root (or sudo without a password)"
    if [ "$APT_UPDATED" -eq 0 ]; then
        quietly as_root env DEBIAN_FRONTEND=noninteractive apt-get update
        APT_UPDATED=1
    fi
    say "installing $*"
    quietly as_root env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y --no-install-recommends "$@"
}

# --- the engine ----------------------------------------------------------------------------

answers() { timeout 10 docker -H "$1" version --format '{{.Server.Version}}' >/dev/null 2>&1; }

# The DOCKER_HOST of the first engine that answers, else nothing (status 1).
find_engine() {
    command -v docker >/dev/null 2>&1 || return 1
    local candidate
    for candidate in "${DOCKER_HOST:-}" unix:///var/run/docker.sock "unix://$SOCKET"; do
        if [ -n "$candidate" ] && answers "$candidate"; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}

start_engine() {
    if ! command -v dockerd >/dev/null 2>&1 || ! command -v docker >/dev/null 2>&1; then
        apt_install docker.io
    fi
    command -v dockerd >/dev/null 2>&1 || unavailable "dockerd missing after installing docker.io"
    as_root true || unavailable "no engine answers, and starting one needs root"
    mkdir -p "$HOME_DIR/data" "$HOME_DIR/exec"
    # One of ours that runs but does not answer yet is still starting: wait for it.
    if ! engine_running; then
        rm -f "$PID_FILE" # left by a dockerd that was killed
        say "starting dockerd (state in $HOME_DIR)"
        # No iptables rules: containers reach each other on their bridge and the host
        # through published ports (the userland proxy, bound to loopback), nothing else.
        as_root setsid -f dockerd \
            --data-root "$HOME_DIR/data" --exec-root "$HOME_DIR/exec" --pidfile "$PID_FILE" \
            --host "unix://$SOCKET" --storage-driver=overlay2 \
            --iptables=false --ip-masq=false --ip=127.0.0.1 \
            >>"$LOG" 2>&1 </dev/null 9>&- # not the lock: it outlives this script
    fi
    local deadline=$((SECONDS + 60))
    until answers "unix://$SOCKET"; do
        # dockerd writes its pid file early: once it has, its death ends the wait. -s, not
        # -f: the file exists, empty, for an instant while dockerd writes it.
        if [ "$SECONDS" -ge "$deadline" ] || { [ -s "$PID_FILE" ] && ! engine_running; }; then
            tail -n 20 "$LOG" >&2 || true
            unavailable "dockerd did not come up (log: $LOG)"
        fi
        sleep 0.5
    done
}

engine_running() {
    local pid
    pid="$(cat "$PID_FILE" 2>/dev/null || true)"
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}

stop_engine() {
    local pid
    pid="$(cat "$PID_FILE" 2>/dev/null || true)"
    if [ -z "$pid" ] || ! kill -0 "$pid" 2>/dev/null; then
        say "no engine of ours runs"
        return 0
    fi
    say "stopping dockerd (pid $pid)"
    as_root kill -TERM "$pid"
    # dockerd stops its containers (each with its own grace period) before it exits.
    local deadline=$((SECONDS + 60))
    while kill -0 "$pid" 2>/dev/null; do
        [ "$SECONDS" -lt "$deadline" ] || { as_root kill -KILL "$pid" || true; break; }
        sleep 0.5
    done
    # What it leaves mounted (the host's network namespace handle), innermost first, so
    # that the state home can be deleted.
    awk -v home="$HOME_DIR/" 'index($2, home) == 1 { print $2 }' /proc/mounts | sort -r |
        while read -r mount; do as_root umount "$mount" || true; done
}

ensure_engine() {
    if ! DOCKER_HOST="$(find_engine)"; then
        start_engine
        DOCKER_HOST="unix://$SOCKET"
    fi
    export DOCKER_HOST
}

# debootstrap for the base image, a compose for the sidecar deployment.
ensure_tools() {
    local missing=()
    command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
    if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null 2>&1
    then
        missing+=(docker-compose)
    fi
    [ "${#missing[@]}" -eq 0 ] || apt_install "${missing[@]}"
}

# --- images --------------------------------------------------------------------------------

hash_text() { printf '%s' "$*" | sha256sum | cut -c1-64; }
# The content, names and modes of every file under a directory.
hash_dir() {
    (
        cd "$1"
        find . -type f ! -name '*.pyc' -print0 | LC_ALL=C sort -z |
            xargs -0 -r stat -c '%a %n' --
        find . -type f ! -name '*.pyc' -print0 | LC_ALL=C sort -z | xargs -0 -r sha256sum --
    ) | sha256sum | cut -c1-64
}
image_inputs() { docker image inspect -f "{{ index .Config.Labels \"$LABEL\" }}" "$1" 2>/dev/null; }
image_id() { docker image inspect -f '{{.Id}}' "$1"; }

# The Debian mirror (and security mirror) apt uses here, so the images fetch from the same.
debian_uri() {
    local suffix="$1" uri
    uri="$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
        /etc/apt/sources.list.d/*.sources 2>/dev/null |
        awk -v pattern="^https?://.*/$suffix/?\$" '
            $1 == "deb" || $1 == "URIs:" {
                for (i = 2; i <= NF; i++) if ($i ~ pattern) { print $i; exit }
            }')"
    echo "${uri%/}"
}
MIRROR="$(debian_uri debian)"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
SECURITY="$(debian_uri debian-security)"

# A minimal Debian with apt set up for images: no recommends, no documentation or locales.
build_base() {
    local build="$1" rootfs="$1/rootfs"
    as_root true || unavailable "building the base image needs root (debootstrap)"
    say "building $BASE_IMAGE with debootstrap from $MIRROR"
    quietly as_root debootstrap --variant=minbase "$SUITE" "$rootfs" "$MIRROR"
    {
        echo "deb $MIRROR $SUITE main"
        echo "deb $MIRROR $SUITE-updates main"
        [ -z "$SECURITY" ] || echo "deb $SECURITY $SUITE-security main"
    } >"$rootfs/etc/apt/sources.list"
    cat >"$rootfs/etc/apt/apt.conf.d/90container" <<'EOF'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
Acquire::Languages "none";
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/*.bin || true"; };
EOF
    cat >"$rootfs/etc/dpkg/dpkg.cfg.d/90container" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/lintian/*
EOF
    find "$rootfs/usr/share/doc" -mindepth 1 ! -name copyright ! -type d -delete
    # The man directories stay: update-alternatives (Java's postinst) links into them.
    find "$rootfs/usr/share/man" ! -type d -delete
    rm -rf "$rootfs"/usr/share/{info,locale,lintian}/* "$rootfs"/var/lib/apt/lists/* \
        "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin \
        "$rootfs"/var/log/*.log "$rootfs"/var/log/apt/*
    tar -C "$rootfs" -c . | quietly docker import \
        --change "LABEL $LABEL=$2" \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["bash"]' - "$BASE_IMAGE"
}

ensure_base() {
    # The recipe itself is the input: the function's text, the suite and the mirrors.
    local inputs
    inputs="$(hash_text "$(declare -f build_base)" "$SUITE" "$MIRROR" "$SECURITY")"
    if [ "$(image_inputs "$BASE_IMAGE" || true)" = "$inputs" ]; then
        say "$BASE_IMAGE up to date"
        return 0
    fi
    local old
    old="$(image_id "$BASE_IMAGE" 2>/dev/null || true)"
    BUILD_DIR="$(mktemp -d "$HOME_DIR/build.XXXXXX")"
    trap 'as_root rm -rf "$BUILD_DIR"' EXIT
    build_base "$BUILD_DIR" "$inputs"
    as_root rm -rf "$BUILD_DIR"
    trap - EXIT
    forget "$old" "$BASE_IMAGE"
}

# Copies a file or directory into a build context: hard links where the file system allows
# (the Kafka jars are 55 MB), else a copy.
stage() {
    mkdir -p "$(dirname "$2")"
    cp -al "$1" "$2" 2>/dev/null || cp -a "$1" "$2"
}

BUILDER=()
# BuildKit where its builder is installed, else the classic builder (the same Dockerfiles).
docker buildx version >/dev/null 2>&1 || BUILDER=(env DOCKER_BUILDKIT=0)

# Builds image name:tag from deploy/containers/<name>.Dockerfile and the staged context,
# unless the image's inputs (context, Dockerfile, base image) are unchanged; also tags
# name:latest.
build_image() {
    local name="$1" tag="$2" context="$3" image="$REPO/$1:$2" inputs
    shift 3 # the rest: more arguments of docker build
    cp "$HERE/$name.Dockerfile" "$context/Dockerfile"
    inputs="$(hash_text "$(hash_dir "$context")" "$(image_id "$BASE_IMAGE")")"
    if [ "$(image_inputs "$image" || true)" = "$inputs" ]; then
        say "$image up to date"
        docker tag "$image" "$REPO/$name:latest"
        return 0
    fi
    say "building $image"
    local started=$SECONDS old
    old="$(image_id "$REPO/$name:latest" 2>/dev/null || true)"
    quietly "${BUILDER[@]}" docker build --force-rm --network host \
        --build-arg "BASE=$BASE_IMAGE" --label "$LABEL=$inputs" \
        --label "org.opencontainers.image.version=$tag" "$@" -t "$image" "$context"
    docker tag "$image" "$REPO/$name:latest"
    forget "$old" "$image"
    say "built $image in $((SECONDS - started)) s"
}

# Removes the image a rebuild replaced (its layers, not the build cache, which later builds
# reuse); one still in use by a container stays.
forget() {
    [ -n "$1" ] && [ "$1" != "$(image_id "$2")" ] || return 0
    docker rmi "$1" >/dev/null 2>&1 || true
}

# The images built on the base.
ensure_images() {
    local build
    BUILD_DIR="$(mktemp -d "$HOME_DIR/context.XXXXXX")"
    build="$BUILD_DIR"
    trap 'rm -rf "$BUILD_DIR"' EXIT

    [ -f "$KAFKA_LIBS/kafka_2.13-$KAFKA_VERSION.jar" ] ||
        die "no Kafka $KAFKA_VERSION jars in $KAFKA_LIBS: run deploy/setup.sh first"
    stage "$KAFKA_LIBS" "$build/kafka/libs"
    rm -f "$build/kafka/libs/.pom.sha256"
    stage "$HERE/kafka" "$build/kafka/image"
    build_image kafka "$KAFKA_VERSION" "$build/kafka"

    mkdir -p "$build/redis"
    stage "$HERE/redis" "$build/redis/image"
    build_image redis "$SUITE" "$build/redis"

    if [ -x "$TOXIPROXY_BIN" ]; then
        stage "$TOXIPROXY_BIN" "$build/toxiproxy/toxiproxy-server"
        build_image toxiproxy "$TOXIPROXY_VERSION" "$build/toxiproxy"
    else
        say "no Toxiproxy binary at $TOXIPROXY_BIN (deploy/setup.sh builds it with Go):" \
            "image $REPO/toxiproxy skipped"
    fi

    # The product only: what `pip wheel` of the repository root needs, and the image's files.
    mkdir -p "$build/proxy"
    for path in pyproject.toml README.md proxy dedup; do
        cp -a "$ROOT/$path" "$build/proxy/$path"
    done
    find "$build/proxy" \( -name __pycache__ -o -name '*.egg-info' -o -name target \
        -o -name '_records*.so' \) -prune -exec rm -rf {} +
    # The wheel, with the Rust record scan (dedup._records), built here where cargo is: the
    # image has no Rust toolchain (Debian's is too old for PyO3). Without cargo the image
    # builds the wheel itself, and the proxy reads every batch in Python.
    mkdir -p "$build/proxy/wheels"
    if command -v cargo >/dev/null 2>&1 || [ -x "$HOME/.cargo/bin/cargo" ]; then
        (export PATH="$PATH:$HOME/.cargo/bin" && quietly "$ROOT/.venv/bin/python" -m pip wheel \
            --no-deps --no-build-isolation --wheel-dir "$build/proxy/wheels" "$ROOT") ||
            say "the product's wheel did not build here: the image builds it, without Rust"
    fi
    stage "$HERE/proxy" "$build/proxy/image"
    # The build stage installs from the package index pip uses here, trusting what it trusts
    # (a TLS-inspecting proxy's CA, say); neither reaches the final image.
    local ca="${PIP_CERT:-${REQUESTS_CA_BUNDLE:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}}"
    if [ -f "$ca" ]; then cp "$ca" "$build/proxy/build-ca.crt"; else : >"$build/proxy/build-ca.crt"; fi
    build_image proxy "$PRODUCT_VERSION" "$build/proxy" \
        --build-arg PIP_INDEX_URL --build-arg PIP_EXTRA_INDEX_URL --build-arg PIP_TRUSTED_HOST

    rm -rf "$build"
    trap - EXIT
}

check_runs() {
    docker run --rm --network none "$BASE_IMAGE" true >/dev/null 2>"$HOME_DIR/run-check.log" ||
        unavailable "the engine cannot run a container: $(tail -n 3 "$HOME_DIR/run-check.log")"
}

# One caller at a time: two test sessions must not start two engines or build twice.
with_lock() {
    mkdir -p "$HOME_DIR"
    exec 9>>"$HOME_DIR/lock"
    flock 9
}

case "${1:-up}" in
up)
    with_lock
    ensure_engine
    ensure_tools
    ensure_base
    check_runs
    ensure_images
    echo "$DOCKER_HOST"
    ;;
images)
    with_lock
    DOCKER_HOST="$(find_engine)" || unavailable "no engine answers: run engine.sh up"
    export DOCKER_HOST
    ensure_tools
    ensure_base
    ensure_images
    echo "$DOCKER_HOST"
    ;;
host)
    find_engine || unavailable "no engine answers"
    ;;
stop)
    with_lock
    stop_engine
    ;;
*)
    die "usage: engine.sh [up|images|host|stop]"
    ;;
esac
