#!/bin/bash
# Puts the cluster's munge key in place from Key Vault, with this machine's user-assigned managed
# identity: IMDS token for Key Vault -> the secret -> /etc/munge/munge.key (munge's alone, 0400).
# The key never travels in custom data; the token and the key never reach argv, stdout or a log.
# Safe to re-run. IMDS_ENDPOINT replaces the IMDS token URL (tests).
set -euo pipefail

VAULT_URI=@VAULT_URI@
SECRET_NAME=@SECRET_NAME@
IDENTITY_CLIENT_ID=@IDENTITY_CLIENT_ID@
KEY_PATH=@KEY_PATH@
readonly KEY_OWNER=munge:munge
readonly MIN_KEY_BYTES=32 # munged refuses shorter keys
readonly IMDS_TOKEN_URL="${IMDS_ENDPOINT:-http://169.254.169.254/metadata/identity/oauth2/token}?api-version=2018-02-01&resource=https%3A%2F%2Fvault.azure.net&client_id=$IDENTITY_CLIENT_ID"
readonly SECRET_URL="${VAULT_URI%/}/secrets/$SECRET_NAME?api-version=7.4"
# A new role assignment can take up to 30 minutes to propagate; so can the identity on a new VM.
readonly RETRY_FOR_SECONDS=${MUNGE_KEY_RETRY_FOR_SECONDS:-2700}
readonly RETRY_SECONDS=${MUNGE_KEY_RETRY_SECONDS:-10}
readonly MAX_RETRY_SECONDS=300

log() { echo "munge-key: $*" >&2; }

# include azure-common.sh

# Runs in an `if`, where set -e is off: every step checks its own status.
# shellcheck disable=SC2317  # run through retry, which shellcheck cannot follow
fetch_once() {
  local tmp
  tmp=$(mktemp "$KEY_PATH.XXXXXX") || return 1
  if key_vault_secret "$SECRET_URL" "$IMDS_TOKEN_URL" | base64 -d >"$tmp" &&
    (($(stat -c %s "$tmp") >= MIN_KEY_BYTES)) &&
    chown "$KEY_OWNER" "$tmp" && chmod 0400 "$tmp" && mv -f "$tmp" "$KEY_PATH"; then
    return 0
  fi
  rm -f "$tmp"
  return 1
}

umask 077
if retry fetch_once; then
  log "the munge key is in $KEY_PATH"
  exit 0
fi
log "could not read secret $SECRET_NAME from $VAULT_URI within ${RETRY_FOR_SECONDS}s"
exit 1
