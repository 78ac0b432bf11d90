# Functions shared by the host scripts that call Azure with the machine's identity (acr-login.sh,
# munge-key.sh). Not a program: render_script pastes it where a template says
# `# include azure-common.sh`. The including script defines log(), ATTEMPTS and RETRY_SECONDS.

# Prints one field of the JSON object on stdin; on failure names the field, never the document.
# shellcheck disable=SC2317  # called from functions that run through retry
json_field() {
  python3 -c '
import json, sys
value = json.load(sys.stdin).get(sys.argv[1])
if not value:
    sys.exit("response has no " + sys.argv[1])
print(value)
' "$1"
}

# Runs "$@" until it succeeds, at most ATTEMPTS times, RETRY_SECONDS apart (a new identity or role
# assignment can take minutes to reach a new VM); 1 when every attempt failed.
retry() {
  local attempt
  for ((attempt = 1; attempt <= ATTEMPTS; attempt++)); do
    if "$@"; then
      return 0
    fi
    if ((attempt < ATTEMPTS)); then
      log "attempt $attempt/$ATTEMPTS failed; retrying in ${RETRY_SECONDS}s"
      sleep "$RETRY_SECONDS"
    fi
  done
  return 1
}
