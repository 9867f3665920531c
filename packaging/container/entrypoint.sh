#!/bin/sh
# The container's entrypoint: `gpuwarden run` with [remediation] node_name set to $NODE_NAME, the node's name at
# the Kubernetes API server (the DaemonSet takes it from the downward API, spec.nodeName). The configuration
# ($GPUWARDEN_CONFIG, a ConfigMap) is read-only and must not set node_name itself; the one with node_name added is
# written to $GPUWARDEN_RUNTIME_DIR. Any other command (`status`, `preflight`, ...) goes to gpuwarden unchanged.
set -eu

config=${GPUWARDEN_CONFIG:-/etc/gpuwarden/gpuwarden.toml}
runtime_dir=${GPUWARDEN_RUNTIME_DIR:-/run/gpuwarden}

if [ "${1:-}" != run ] || [ -z "${NODE_NAME:-}" ]; then
    exec gpuwarden "$@"
fi
shift

# A node name is an RFC 1123 subdomain: nothing in it can break out of a TOML string.
case $NODE_NAME in
    *[!a-z0-9.-]* | [.-]* | *[.-])
        echo "gpuwarden-entrypoint: NODE_NAME=$NODE_NAME is not a Kubernetes node name" >&2
        exit 2 ;;
esac
if [ ${#NODE_NAME} -gt 253 ]; then
    echo "gpuwarden-entrypoint: NODE_NAME is longer than 253 characters" >&2
    exit 2
fi

rendered=$runtime_dir/gpuwarden.toml
mkdir -p "$runtime_dir"
umask 022
tmp=$rendered.tmp
# node_name goes right under the [remediation] header (or in a table of that name added at the end). Should the
# file set node_name itself, the key is then there twice, and the agent refuses the file naming it: loud, never a
# silent choice between the two.
found=0
{
    while IFS= read -r line || [ -n "$line" ]; do
        printf '%s\n' "$line"
        if [ $found = 0 ]; then
            case $line in
                "[remediation]" | "[remediation]"[[:space:]#]*)
                    printf 'node_name = "%s"\n' "$NODE_NAME"
                    found=1 ;;
            esac
        fi
    done
    if [ $found = 0 ]; then
        printf '\n[remediation]\nnode_name = "%s"\n' "$NODE_NAME"
    fi
} < "$config" > "$tmp"
mv "$tmp" "$rendered"

exec gpuwarden run --config "$rendered" "$@"
