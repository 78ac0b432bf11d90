# The fstab entry and the bounded wait of the shared file system's mount programs (nfs-mount.sh,
# lustre-mount.sh). Not a program: render_script pastes it where a template says
# `# include mount-wait.sh`. The including script defines SOURCE, MOUNT_PATH, FS_TYPE and MOUNT_OPTIONS.

readonly FSTAB=/etc/fstab
# The file system may still be coming up when the hosts boot (the NFS server building its array).
readonly WAIT_SECONDS=1200
readonly ATTEMPT_SECONDS=60
readonly RETRY_SECONDS=10

# Adds the fstab entry once (later boots mount from it), then mounts until it is mounted or the wait is
# spent; the last line on stderr says why it failed (the boot report's reason).
mount_shared() {
  local deadline
  mkdir -p "$MOUNT_PATH"
  if ! awk -v path="$MOUNT_PATH" '$2 == path { found = 1 } END { exit !found }' "$FSTAB"; then
    printf '%s %s %s %s 0 0\n' "$SOURCE" "$MOUNT_PATH" "$FS_TYPE" "$MOUNT_OPTIONS" >>"$FSTAB"
    systemctl daemon-reload
  fi
  deadline=$((SECONDS + WAIT_SECONDS))
  until mountpoint -q "$MOUNT_PATH"; do
    if ((SECONDS >= deadline)); then
      log "$SOURCE did not answer within ${WAIT_SECONDS}s"
      return 1
    fi
    if ! timeout "$ATTEMPT_SECONDS" mount "$MOUNT_PATH"; then
      log "$SOURCE not mountable yet; retrying in ${RETRY_SECONDS}s"
      sleep "$RETRY_SECONDS"
    fi
  done
  log "mounted $SOURCE at $MOUNT_PATH"
}
