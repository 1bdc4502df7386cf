#!/usr/bin/env bash
# Prepares a machine for kafka-dedup-proxy: the Python virtualenv with the product (editable,
# with its dev and spark extras) and the lab (deploy/pyproject.toml, editable), Redis and
# kcat, a Java runtime with Maven, the Kafka jars resolved from deploy/kafka/pom.xml, Spark's
# Kafka source for the Spark job (deploy/spark/pom.xml), and the Toxiproxy server (built with
# Go) the chaos suite injects network faults with. Versions are pinned once each, in the
# files this script reads: kafka.version in deploy/kafka/pom.xml, spark.version in
# deploy/spark/pom.xml (checked against the installed pyspark, pinned in pyproject.toml) and
# deploy/versions.env; deploy/paths.py reads the same.
# Idempotent and quick on a machine that is already set up: each step is skipped when its
# result is present (the slow ones are keyed by a hash of their input file, or a version).
set -euo pipefail

say() { printf 'setup: %s\n' "$*"; }
warn() { printf 'setup: warning: %s\n' "$*" >&2; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }
hash_of() { cat "$@" | sha256sum | cut -d' ' -f1; }
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LIB_TAG=setup
# shellcheck source=lib.sh
source "$ROOT/deploy/lib.sh"
VENV="$ROOT/.venv"
POM="$ROOT/deploy/kafka/pom.xml"
SPARK_POM="$ROOT/deploy/spark/pom.xml"
KAFKA_VERSION="$(pom_property "$POM" kafka.version)"
SPARK_VERSION="$(pom_property "$SPARK_POM" spark.version)"
# shellcheck source=versions.env
source "$ROOT/deploy/versions.env"
[ -n "${TOXIPROXY_VERSION:-}" ] || die "deploy/versions.env sets no TOXIPROXY_VERSION"
CACHE_HOME="$(xdg_dir "${XDG_CACHE_HOME:-}" "$HOME/.cache")"
KAFKA_CACHE="$CACHE_HOME/kafka-dedup-proxy/kafka-$KAFKA_VERSION"
LIBS="$KAFKA_CACHE/libs"
TOXIPROXY_DIR="$CACHE_HOME/kafka-dedup-proxy/toxiproxy-$TOXIPROXY_VERSION"
TOXIPROXY_BIN="$TOXIPROXY_DIR/toxiproxy-server"

# `setup.sh --versions`: print the pins this script installs, change nothing (tests compare
# them with deploy/paths.py).
if [ "${1:-}" = "--versions" ]; then
    printf 'KAFKA_VERSION=%s\nSPARK_VERSION=%s\nTOXIPROXY_VERSION=%s\n' \
        "$KAFKA_VERSION" "$SPARK_VERSION" "$TOXIPROXY_VERSION"
    exit 0
fi

# Root runs apt-get directly; anyone else needs a sudo that works without a prompt on CI.
as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        die "need root (or sudo) to run: $*"
    fi
}

APT_UPDATED=0
apt_install() {
    command -v apt-get >/dev/null 2>&1 || die "apt-get not found; install by hand: $*"
    if [ "$APT_UPDATED" -eq 0 ]; then
        quietly as_root env DEBIAN_FRONTEND=noninteractive apt-get update
        APT_UPDATED=1
    fi
    quietly as_root env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y --no-install-recommends "$@"
}

# --- Python virtualenv -------------------------------------------------------------------
find_python() {
    local candidate
    for candidate in python3.11 python3; do
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            command -v "$candidate"
            return 0
        fi
    done
    return 1
}

if [ ! -x "$VENV/bin/python" ]; then
    PYTHON="$(find_python)" || die "need python3.11 or a python3 >= 3.11"
    say "creating .venv with $PYTHON"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    quietly "$VENV/bin/python" -m pip install --upgrade pip
fi

# The product with its dev and spark extras, and the lab, both editable, in one pip run (so
# the lab's requirement on the product is met by this checkout, never by a registry).
# The install also builds the Rust extension dedup._records in place (setuptools-rust runs
# cargo): its sources are inputs too, and a missing module means a rebuild.
PY_STAMP="$VENV/.pyproject.sha256"
PY_INPUTS=("$ROOT/pyproject.toml" "$ROOT/deploy/pyproject.toml"
    "$ROOT/dedup/records_native/Cargo.toml" "$ROOT/dedup/records_native/Cargo.lock"
    "$ROOT"/dedup/records_native/src/*.rs)
if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH" # rustup's place, not always on a CI shell's PATH
fi
command -v cargo >/dev/null 2>&1 ||
    warn "no cargo (Rust): dedup._records is not built; the proxy reads batches in Python"
NATIVE_BUILT=0
compgen -G "$ROOT/dedup/_records*.so" >/dev/null && NATIVE_BUILT=1
if [ "$(cat "$PY_STAMP" 2>/dev/null || true)" != "$(hash_of "${PY_INPUTS[@]}")" ] ||
    { [ "$NATIVE_BUILT" -eq 0 ] && command -v cargo >/dev/null 2>&1; }; then
    say "installing the product (with its dev and spark extras) and the lab into .venv"
    (cd "$ROOT" && quietly "$VENV/bin/python" -m pip install -e '.[dev,spark]' -e ./deploy)
    hash_of "${PY_INPUTS[@]}" >"$PY_STAMP"
else
    say ".venv up to date"
fi
PYSPARK_VERSION="$("$VENV/bin/python" -c 'import pyspark; print(pyspark.__version__)')"
[ "$PYSPARK_VERSION" = "$SPARK_VERSION" ] ||
    die "pyspark $PYSPARK_VERSION is installed but deploy/spark/pom.xml pins Spark" \
        "$SPARK_VERSION: make pyproject.toml's pyspark pin and spark.version agree"

# --- Redis and kcat ----------------------------------------------------------------------
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
# redis-cli forms the local Redis Cluster (`local up --redis cluster`); Sentinels run as
# `redis-server --sentinel`, so Debian's redis-sentinel package is not needed.
command -v redis-cli >/dev/null 2>&1 || missing+=(redis-tools)
command -v kcat >/dev/null 2>&1 || missing+=(kcat)
if [ "${#missing[@]}" -gt 0 ]; then
    say "installing ${missing[*]}"
    apt_install "${missing[@]}"
    for program in "${missing[@]/redis-tools/redis-cli}"; do
        command -v "$program" >/dev/null 2>&1 || die "$program still missing after apt-get install"
    done
else
    say "redis-server, redis-cli and kcat present"
fi

# --- Java >= 17 and Maven ----------------------------------------------------------------
java_major() {
    # `java -version` prints e.g. 'openjdk version "17.0.15" ...' (or "1.8.0_x" on old ones).
    local major
    major="$(java -version 2>&1 |
        sed -n 's/.* version "\([0-9]*\)\(\.\([0-9]*\)\)\{0,1\}.*/\1 \3/p' |
        head -n1 | awk '{ print ($1 == 1 ? $2 : $1) }')"
    echo "${major:-0}"
}
if ! command -v java >/dev/null 2>&1 || [ "$(java_major)" -lt 17 ]; then
    say "installing a Java runtime (>= 17 needed)"
    apt_install default-jre-headless
fi
command -v java >/dev/null 2>&1 || die "java not found after install"
JAVA_MAJOR="$(java_major)"
[ "$JAVA_MAJOR" -ge 17 ] || die "java $JAVA_MAJOR found, Kafka $KAFKA_VERSION needs >= 17"

if ! command -v mvn >/dev/null 2>&1; then
    say "installing maven"
    apt_install maven
    command -v mvn >/dev/null 2>&1 || die "mvn still missing after apt-get install"
fi

# --- Kafka jars and Spark's Kafka source --------------------------------------------------
# Copies the runtime jars a pinned descriptor resolves to into a directory, keyed by the
# descriptor's hash. Resolves into a fresh directory and swaps it in, so a failed run leaves
# no half classpath. Arguments: label, pom, destination, a jar that must be there, then any
# extra Maven arguments.
resolve_jars() {
    local label="$1" pom="$2" dest="$3" marker="$4"
    shift 4
    local stamp="$dest/.pom.sha256" staging
    if [ "$(cat "$stamp" 2>/dev/null || true)" = "$(hash_of "$pom")" ] && [ -f "$dest/$marker" ]; then
        say "$label jars up to date"
        return 0
    fi
    say "resolving $label jars into $dest"
    mkdir -p "$(dirname "$dest")"
    staging="$(mktemp -d "$(dirname "$dest")/jars.XXXXXX")"
    trap 'rm -rf "$staging"' EXIT
    quietly mvn -B -Dstyle.color=never "$@" -f "$pom" dependency:copy-dependencies \
        -DoutputDirectory="$staging" -DincludeScope=runtime
    [ -f "$staging/$marker" ] || die "$label: $marker missing after resolving $pom"
    hash_of "$pom" >"$staging/.pom.sha256"
    rm -rf "$dest"
    mv "$staging" "$dest"
    trap - EXIT
}

resolve_jars "Kafka $KAFKA_VERSION" "$POM" "$LIBS" "kafka_2.13-$KAFKA_VERSION.jar"

# The directory dedup/spark/runtime.py spark_jars_dir looks in by default.
resolve_jars "Spark $SPARK_VERSION Kafka source" "$SPARK_POM" \
    "$CACHE_HOME/kafka-dedup-proxy/spark-$SPARK_VERSION/jars" \
    "spark-sql-kafka-0-10_2.13-$SPARK_VERSION.jar" -s "$ROOT/deploy/spark/maven-settings.xml"

# --- Toxiproxy ----------------------------------------------------------------------------
# Built from source through the Go module proxy, which build machines reach more often than
# GitHub's release downloads. Only the chaos suite needs it, so a machine without Go gets a
# warning and everything else; a build that fails with Go present is an error.
find_go() {
    if command -v go >/dev/null 2>&1; then
        command -v go
    elif [ -x /usr/local/go/bin/go ]; then
        echo /usr/local/go/bin/go # the official tarball's place, often not on PATH
    else
        return 1
    fi
}
# The binary is stamped with its version at build time, so `-version` keys this step.
toxiproxy_version() { "$TOXIPROXY_BIN" -version 2>/dev/null | awk '{ print $NF }'; }

TOXIPROXY_MISSING=0
if [ "$(toxiproxy_version || true)" = "$TOXIPROXY_VERSION" ]; then
    say "Toxiproxy $TOXIPROXY_VERSION present"
elif GO="$(find_go)"; then
    say "building Toxiproxy $TOXIPROXY_VERSION into $TOXIPROXY_DIR"
    mkdir -p "$TOXIPROXY_DIR"
    staging="$(mktemp -d "$TOXIPROXY_DIR/build.XXXXXX")"
    trap 'rm -rf "$staging"' EXIT
    # Static (no C compiler needed). A Go older than the module's minimum fetches the
    # toolchain it needs through the same module proxy (GOTOOLCHAIN=auto, Go >= 1.21).
    quietly env GOBIN="$staging" CGO_ENABLED=0 "$GO" install -trimpath \
        -ldflags "-s -w -X github.com/Shopify/toxiproxy/v2.Version=$TOXIPROXY_VERSION" \
        "github.com/Shopify/toxiproxy/v2/cmd/server@v$TOXIPROXY_VERSION"
    mv "$staging/server" "$TOXIPROXY_BIN"
    rm -rf "$staging"
    trap - EXIT
    [ "$(toxiproxy_version || true)" = "$TOXIPROXY_VERSION" ] ||
        die "$TOXIPROXY_BIN does not report version $TOXIPROXY_VERSION"
else
    TOXIPROXY_MISSING=1
    warn "go not found: Toxiproxy $TOXIPROXY_VERSION was not built, so the chaos suite" \
        "(dedup-proxy chaos run, tests/integration/test_toxiproxy.py) cannot run;" \
        "install Go >= 1.21 (https://go.dev/dl/) and run this script again"
fi

if [ "$TOXIPROXY_MISSING" -eq 1 ]; then
    say "done, without Toxiproxy"
else
    say "done"
fi
