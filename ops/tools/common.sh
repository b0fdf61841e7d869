# Shared settings for the tool builders in ops/tools (sourced, not run).
#
# Every tool is built from its Go module through the Go module proxy, once, into $K3_CACHE/bin under a
# versioned name (helm-v3.21.4, ...). A later call finds the binary and returns at once, so CI and tests
# never rebuild; only a changed version in versions.env builds again. Builds run under `nice` because they
# are long and may share the machine.
#   K3_CACHE        cache root (default ~/.cache/k3)
#   K3_GO_BUILD_P   parallel compile jobs for `go build -p` (default 2)
#   K3_BUILD_NICE   niceness of the compilers (default 10; 0 when a build must not be starved)

K3_CACHE="${K3_CACHE:-$HOME/.cache/k3}"
K3_TOOLS_BIN="$K3_CACHE/bin"
K3_GO_BUILD_P="${K3_GO_BUILD_P:-2}"
K3_BUILD_NICE="${K3_BUILD_NICE:-10}"
# shellcheck source=versions.env
source "$(dirname "${BASH_SOURCE[0]}")/versions.env"

# Exit status 2 means "a prerequisite is missing" everywhere in ops/; callers show the message as is.
die_missing() {
    echo "tools: $*" >&2
    exit 2
}

die() {
    echo "tools: $*" >&2
    exit 1
}

require_go() {
    command -v go >/dev/null 2>&1 || die_missing "go not found; install a Go toolchain (apt-get install golang-go, 1.25+)"
}

# Prints the cached binary $1-$2 (name, version) and returns 0, or returns 1 when it is not built yet.
cached_tool() {
    local path="$K3_TOOLS_BIN/$1-$2"
    [[ -x "$path" ]] || return 1
    echo "$path"
}

# Moves a freshly built binary into the cache under its versioned name; the rename is atomic, so a
# half-written file is never taken for a finished build.
install_tool() {
    local built="$1" name="$2" version="$3"
    mkdir -p "$K3_TOOLS_BIN"
    cp "$built" "$K3_TOOLS_BIN/.$name-$version.partial"
    chmod +x "$K3_TOOLS_BIN/.$name-$version.partial"
    mv "$K3_TOOLS_BIN/.$name-$version.partial" "$K3_TOOLS_BIN/$name-$version"
    echo "$K3_TOOLS_BIN/$name-$version"
}
