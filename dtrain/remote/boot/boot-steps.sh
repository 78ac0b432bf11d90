# The step runner of the first-boot programs (node-setup.sh, head-setup.sh). Not a program:
# render_script pastes it where a template says `# include boot-steps.sh`. The including script
# defines log(), NODE_NAME, STEPS (its step names, in order), STEPS_DIR (this boot's results: under /run, so a
# new boot runs every step again), SHARED_MOUNT and REPORT_DIR (the boot reports beneath it).

# Runs "$@" as step $1 unless it succeeded earlier in this boot; records `ok`, or `failed: ` and the
# last line the step wrote to stderr (its reason), and rewrites the boot report. 1 when it failed.
step() {
  local name=$1 result
  shift
  if step_ok "$name"; then
    return 0
  fi
  log "$name: starting"
  # the report says which step the boot is in, and since when (`dtrain status`, `launch --follow`)
  printf 'running since %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$STEPS_DIR/$name"
  write_report
  if "$@" 2>"$STEPS_DIR/$name.err"; then
    result=ok
  else
    result="failed: $(tail -n 1 "$STEPS_DIR/$name.err" | tr -d '\r')"
  fi
  cat "$STEPS_DIR/$name.err" >&2
  log "$name: $result"
  printf '%s\n' "$result" >"$STEPS_DIR/$name"
  write_report
  [[ $result == ok ]]
}

# The boot report, key=value lines: ok (1 once every step succeeded), each step's result (`pending`
# before it ran, `running since <time>` while it runs), updated_at. Kept in STEPS_DIR, and copied to the shared file system (REPORT_DIR/<this
# machine's Slurm name>, 0644) whenever that is mounted, so that `dtrain status` shows it even when
# slurmd could not start.
write_report() {
  local name result all_ok=1 report="$STEPS_DIR/report" tmp
  tmp=$(mktemp "$STEPS_DIR/report.XXXXXX")
  for name in "${STEPS[@]}"; do
    result=pending
    [[ -f $STEPS_DIR/$name ]] && result=$(<"$STEPS_DIR/$name")
    [[ $result == ok ]] || all_ok=0
    printf '%s=%s\n' "$name" "$result" >>"$tmp"
  done
  printf 'ok=%s\nupdated_at=%s\n' "$all_ok" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" >>"$tmp"
  chmod 0644 "$tmp" && mv -f "$tmp" "$report"
  mountpoint -q "$SHARED_MOUNT" || return 0
  # a step in the background (node-setup's registry login) may write it at the same time: own temp names
  local shared="$SHARED_MOUNT/$REPORT_DIR" partial=".$NODE_NAME.$BASHPID"
  if ! { mkdir -p "$shared" && cp "$report" "$shared/$partial" && mv -f "$shared/$partial" "$shared/$NODE_NAME"; }; then
    log "could not write the boot report to $shared"
  fi
}

# 0 when step $1 has succeeded in this boot.
step_ok() {
  [[ -f $STEPS_DIR/$1 && $(<"$STEPS_DIR/$1") == ok ]]
}

# 0 once every step has succeeded in this boot; otherwise names the failed ones and returns 1.
all_steps_ok() {
  local name failed=()
  for name in "${STEPS[@]}"; do
    step_ok "$name" || failed+=("$name")
  done
  ((${#failed[@]} == 0)) && return 0
  log "failed: ${failed[*]}; tried again in 30 minutes and at the next boot"
  return 1
}
