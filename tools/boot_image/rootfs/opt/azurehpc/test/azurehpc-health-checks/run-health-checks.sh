#!/bin/sh
# The boot test's stand-in for Azure's node health checks (azurehpc-health-checks' entry point, where
# the ubuntu-hpc image carries it; tools/build_boot_image.sh): it takes the entry point's -c CONF and
# -o LOG and writes to LOG the lines that NHC writes. The check named in /etc/boot-test/azure-checks.fail
# (one line: the check and what it measured, as NHC words it) fails, as NHC fails one: "Health check
# failed: <that line>", exit status 1. Without the file, every check passes.
set -eu
conf='' log=./health.log
while getopts c:o:t:v opt; do
  case $opt in
    c) conf=$OPTARG ;;
    o) log=$OPTARG ;;
    *) ;;
  esac
done
[ -f "$conf" ] || { echo "The conf file $conf does not exist." >&2; exit 1; }
echo "azurehpc-health-checks (boot test stand-in) with $conf:" >>"$log"
cat "$conf" >>"$log"
fault=/etc/boot-test/azure-checks.fail
if [ -f "$fault" ]; then
  echo "ERROR:  nhc:  Health check failed:  $(cat "$fault")" >>"$log"
  echo "Health checks completed with exit code: 1." >>"$log"
  exit 1
fi
echo "Health checks completed with exit code: 0." >>"$log"
