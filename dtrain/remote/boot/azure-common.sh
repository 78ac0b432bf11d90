# Functions shared by the host scripts that call Azure with the machine's identity (acr-login.sh,
# munge-key.sh, slurmdbd-setup.sh). Not a program: render_script pastes it where a template says
# `# include azure-common.sh`. The including script defines log(), RETRY_FOR_SECONDS,
# RETRY_SECONDS and MAX_RETRY_SECONDS.

# Prints one field of the JSON object on stdin; on failure names the field, never the document.
# shellcheck disable=SC2317  # called from functions that run through retry
json_field() {
  python3 -c '
import json, sys
try:
    value = json.load(sys.stdin).get(sys.argv[1])
except (ValueError, AttributeError):  # nothing (curl failed, its reason is above) or not an object
    sys.exit("response is not a JSON object with " + sys.argv[1])
if not value:
    sys.exit("response has no " + sys.argv[1])
print(value)
' "$1"
}

# Runs "$@" until it succeeds or RETRY_FOR_SECONDS have passed, waiting RETRY_SECONDS after the first
# failure and twice as long after each next one, up to MAX_RETRY_SECONDS: a new identity or role
# assignment can take up to 30 minutes to reach a new VM (Azure's RBAC troubleshooting guide), and
# until then Key Vault and ACR answer 403, which curl's message names in the log. 1 when it gave up.
retry() {
  local attempt=1 delay=$RETRY_SECONDS deadline=$((SECONDS + RETRY_FOR_SECONDS))
  until "$@"; do
    if ((SECONDS + delay > deadline)); then
      log "attempt $attempt failed; giving up after ${RETRY_FOR_SECONDS}s"
      return 1
    fi
    log "attempt $attempt failed (the reason is above); retrying in ${delay}s"
    sleep "$delay"
    attempt=$((attempt + 1))
    delay=$((delay * 2 > MAX_RETRY_SECONDS ? MAX_RETRY_SECONDS : delay * 2))
  done
}

# Prints the value of the Key Vault secret at URL $1, read with the token that IMDS at URL $2 issues
# to this machine's identity for Key Vault. The token travels as a header read from stdin (-H @-), never
# in curl's argv; the value goes to stdout only, for the caller to put where it belongs.
# shellcheck disable=SC2317  # called from functions that run through retry
key_vault_secret() {
  local token
  token=$(curl -fsS --max-time 30 -H Metadata:true "$2" | json_field access_token) || return 1
  printf 'Authorization: Bearer %s\n' "$token" | curl -fsS --max-time 30 -H @- "$1" | json_field value
}
