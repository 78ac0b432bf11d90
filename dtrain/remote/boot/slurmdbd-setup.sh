#!/bin/bash
# Sets up slurmdbd on the head node; head-setup's slurmdbd step runs it at every boot until it has
# succeeded once, after the cluster's munge key is in place. Safe to re-run:
#   1. the database password from Key Vault, with this machine's user-assigned identity: it is never in
#      custom data, argv or a log, only in slurmdbd.conf (slurm's alone, 0600) and MariaDB;
#   2. with MariaDB on this node (LOCAL_DATABASE=1): its buffer pool sized to this machine's memory, MariaDB
#      running with its settings, and slurmdbd's database user with that password (made, or given it
#      again); with a database elsewhere: the CA bundle its certificate must chain to, from this
#      machine's own trust store;
#   3. slurmdbd.conf, the rendered file and its StoragePass, and slurmdbd (re)started;
#   4. the cluster, its default account and its users (sacctmgr load: changes nothing when there), once
#      slurmdbd answers: slurmctld runs no job without them.
# IMDS_ENDPOINT replaces the IMDS token URL (tests).
set -euo pipefail

VAULT_URI=@VAULT_URI@
SECRET_NAME=@SECRET_NAME@
IDENTITY_CLIENT_ID=@IDENTITY_CLIENT_ID@
LOCAL_DATABASE=@LOCAL_DATABASE@
MEMORY_CONF=@MEMORY_CONF@
MEMORY_SHARE=@MEMORY_SHARE@
MIN_BUFFER_POOL_MB=@MIN_BUFFER_POOL_MB@
GRANT_SQL=@GRANT_SQL@
CA_BUNDLE=@CA_BUNDLE@
CA_SOURCES=@CA_SOURCES@
TEMPLATE=@TEMPLATE@
CONF=@CONF@
ASSOCIATIONS=@ASSOCIATIONS@
readonly CONF_OWNER=slurm:slurm
readonly IMDS_TOKEN_URL="${IMDS_ENDPOINT:-http://169.254.169.254/metadata/identity/oauth2/token}?api-version=2018-02-01&resource=https%3A%2F%2Fvault.azure.net&client_id=$IDENTITY_CLIENT_ID"
readonly SECRET_URL="${VAULT_URI%/}/secrets/$SECRET_NAME?api-version=7.4"
# A new role assignment can take up to 30 minutes to propagate, as for the munge key.
readonly RETRY_FOR_SECONDS=${SLURMDBD_SETUP_RETRY_FOR_SECONDS:-2700}
readonly RETRY_SECONDS=10
readonly MAX_RETRY_SECONDS=300
# slurmdbd makes its tables at its first start, and its database may take its time to answer.
readonly ANSWER_WAIT_SECONDS=300

log() { echo "slurmdbd-setup: $*" >&2; }

# include azure-common.sh

# shellcheck disable=SC2317  # run through retry, which shellcheck cannot follow
fetch_password() {
  PASSWORD=$(key_vault_secret "$SECRET_URL" "$IMDS_TOKEN_URL") && [ -n "$PASSWORD" ]
}

# Slurm's advice: 5-50% of the server's memory and at least 4 GiB; here MEMORY_SHARE of it, raised to
# 4 GiB where that stays under half. The redo log a quarter of it, at most 1 GiB (a larger one only
# lengthens recovery after a crash).
memory_settings() {
  local memory_mb pool_mb
  memory_mb=$(awk '/^MemTotal:/ { print int($2 / 1024) }' /proc/meminfo)
  pool_mb=$((memory_mb / MEMORY_SHARE))
  if ((pool_mb < MIN_BUFFER_POOL_MB && MIN_BUFFER_POOL_MB < memory_mb / 2)); then
    pool_mb=$MIN_BUFFER_POOL_MB
  fi
  printf '[mariadbd]\ninnodb_buffer_pool_size=%sM\ninnodb_log_file_size=%sM\n' \
    "$pool_mb" "$((pool_mb / 4 > 1024 ? 1024 : (pool_mb / 4 < 48 ? 48 : pool_mb / 4)))" >"$MEMORY_CONF"
  chmod 0644 "$MEMORY_CONF"
}

local_database() {
  memory_settings
  systemctl enable mariadb
  # its settings (written before its package) are read at start: restarted, whatever the package started
  systemctl restart mariadb
  # as MariaDB's root, through its socket; the SQL, password included, on stdin
  printf '%s\n' "${GRANT_SQL//\{password\}/$PASSWORD}" | mariadb --protocol=socket
}

ca_bundle() {
  local tmp
  tmp=$(mktemp "$CA_BUNDLE.XXXXXX")
  cat "${CA_SOURCES[@]}" >"$tmp" && chmod 0644 "$tmp" && mv -f "$tmp" "$CA_BUNDLE"
}

write_conf() {
  local tmp
  tmp=$(mktemp "$CONF.XXXXXX")
  { cat "$TEMPLATE" && printf 'StoragePass=%s\n' "$PASSWORD"; } >"$tmp"
  chown "$CONF_OWNER" "$tmp" && chmod 0600 "$tmp" && mv -f "$tmp" "$CONF"
}

load_associations() {
  local deadline=$((SECONDS + ANSWER_WAIT_SECONDS))
  until sacctmgr --immediate load "$ASSOCIATIONS" >&2; do
    if ((SECONDS >= deadline)); then
      log "slurmdbd did not take the associations within ${ANSWER_WAIT_SECONDS}s (journalctl -u slurmdbd)"
      return 1
    fi
    sleep 5
  done
}

umask 077
if ! retry fetch_password; then
  log "could not read secret $SECRET_NAME from $VAULT_URI within ${RETRY_FOR_SECONDS}s"
  exit 1
fi
if ((LOCAL_DATABASE)); then
  local_database
else
  ca_bundle
fi
write_conf
systemctl enable slurmdbd
systemctl restart slurmdbd
load_associations
log "slurmdbd runs, with the cluster's associations"
