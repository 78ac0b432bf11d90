#!/bin/bash
# Logs the admin user's docker client in to the registry with the node's user-assigned managed
# identity, without the az CLI: IMDS AAD token -> ACR refresh token (about 3 h) -> docker login.
# Docker-runtime jobs run `docker run` as the admin user, who submits them: the credential goes
# where that user's client reads it (~/.docker/config.json, the user's alone, 0600), written by
# `docker login` running as that user (a member of the docker group, node-setup.sh), so root never
# writes into the user's home. Tokens never reach argv, stdout or the log: they live in variables
# and travel through stdin. Usage: acr-login [SECONDS], how long to keep trying (default 45 minutes).
set -euo pipefail

ACR_LOGIN_SERVER=@ACR_LOGIN_SERVER@
IDENTITY_CLIENT_ID=@IDENTITY_CLIENT_ID@
ADMIN_USER=@ADMIN_USER@
readonly IMDS_TOKEN_URL="http://169.254.169.254/metadata/identity/oauth2/token?api-version=2018-02-01&resource=https://management.azure.com/&client_id=$IDENTITY_CLIENT_ID"
# ACR takes this fixed user name with a refresh token as the password.
readonly ACR_TOKEN_USER=00000000-0000-0000-0000-000000000000
# A new AcrPull role assignment can take up to 30 minutes to propagate; the login at boot tries for
# less (acr-login-boot.service), since slurmd waits for it.
readonly DEFAULT_RETRY_FOR_SECONDS=2700
readonly RETRY_FOR_SECONDS=${1:-$DEFAULT_RETRY_FOR_SECONDS}
readonly RETRY_SECONDS=10
readonly MAX_RETRY_SECONDS=300

log() { echo "acr-login: $*" >&2; }

if [[ ! $RETRY_FOR_SECONDS =~ ^[0-9]+$ ]]; then
  log "usage: acr-login [SECONDS]"
  exit 2
fi

# include azure-common.sh

# Runs in an `if`, where set -e is off: every step checks its own status.
# shellcheck disable=SC2317  # run through retry, which shellcheck cannot follow
login_once() {
  local aad_token refresh_token
  aad_token=$(curl -fsS --max-time 30 -H Metadata:true "$IMDS_TOKEN_URL" | json_field access_token) || return 1
  refresh_token=$(printf 'grant_type=access_token&service=%s&access_token=%s' "$ACR_LOGIN_SERVER" "$aad_token" |
    curl -fsS --max-time 30 --data @- "https://$ACR_LOGIN_SERVER/oauth2/exchange" |
    json_field refresh_token) || return 1
  printf '%s' "$refresh_token" |
    runuser -u "$ADMIN_USER" -- env DOCKER_CONFIG="$DOCKER_CONFIG_DIR" docker login "$ACR_LOGIN_SERVER" \
      --username "$ACR_TOKEN_USER" --password-stdin >&2
}

if ! home=$(getent passwd "$ADMIN_USER" | cut -d: -f6) || [[ -z $home ]]; then
  log "no user $ADMIN_USER on this machine"
  exit 1
fi
# the admin user's docker client reads it there: the job's environment has that user's HOME
readonly DOCKER_CONFIG_DIR=$home/.docker

if retry login_once; then
  log "logged in to $ACR_LOGIN_SERVER"
  exit 0
fi
log "could not log in to $ACR_LOGIN_SERVER within ${RETRY_FOR_SECONDS}s"
exit 1
