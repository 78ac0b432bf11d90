#!/bin/bash
# Registers this node as ready for the launcher: writes <registry>/<hostname>.json atomically
# (temporary file in the same directory, then rename), so readers never see a partial file.
set -euo pipefail

REGISTRY_DIR=@REGISTRY_DIR@
EXPECTED_GPUS=@EXPECTED_GPUS@
readonly IFACE=eth0
readonly IB_SYSFS=/sys/class/infiniband

log() { echo "register-node: $*" >&2; }

# The directory exists only on the NFS export: a node whose mount failed must not register into
# its local disk.
if [ ! -d "$REGISTRY_DIR" ]; then
  log "registry directory $REGISTRY_DIR does not exist; is the shared file system mounted?"
  exit 1
fi

host=$(hostname)
address=$(ip -4 -o addr show dev "$IFACE" primary | awk '{ split($4, cidr, "/"); print cidr[1]; exit }')
if [ -z "$address" ]; then
  log "no IPv4 address on $IFACE"
  exit 1
fi

gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$({ nvidia-smi -L 2>/dev/null || true; } | grep -c '^GPU ' || true)
fi

ib_state=absent
shopt -s nullglob
for port in "$IB_SYSFS"/*/ports/*; do
  # Azure lists the accelerated-networking NIC here too (link layer Ethernet): skip it.
  if [ -r "$port/link_layer" ] && [ "$(<"$port/link_layer")" != InfiniBand ]; then
    continue
  fi
  ib_state=DOWN
  if grep -q ACTIVE "$port/state"; then
    ib_state=ACTIVE
    break
  fi
done

if [ "$gpus" -ne "$EXPECTED_GPUS" ]; then
  log "WARNING: $host sees $gpus GPUs, expected $EXPECTED_GPUS"
fi

ready_at=$(date -u +%Y-%m-%dT%H:%M:%SZ)
tmp=$(mktemp "$REGISTRY_DIR/.$host.json.XXXXXX")
trap 'rm -f "$tmp"' EXIT
python3 - "$tmp" "$host" "$address" "$gpus" "$ib_state" "$ready_at" <<'EOF'
import json
import sys

path, hostname, address, gpus, ib_state, ready_at = sys.argv[1:]
record = {"hostname": hostname, "address": address, "gpus": int(gpus), "ib_state": ib_state, "ready_at": ready_at}
with open(path, "w", encoding="utf-8") as out:
    json.dump(record, out)
    out.write("\n")
EOF
chmod 0644 "$tmp"
mv -f "$tmp" "$REGISTRY_DIR/$host.json"
log "registered $host: $address, $gpus GPUs, InfiniBand $ib_state"
