# The packages step of the setup programs (node-setup.sh, head-setup.sh). Not a program:
# render_script pastes it where a template says `# include packages.sh`. The including script defines
# PACKAGES: its role's packages, a name or name=version (Slurm's, where the version may be a glob of
# package revisions that the apt pin holds too: slurm_packages.py). A boot step, not cloud-init's
# `packages` (once per instance): a repository that fails at first boot is tried again at the next run.

# 0 when the package (a name) is installed.
# shellcheck disable=SC2317  # called from install_packages, which runs through step
is_installed() {
  [[ $(dpkg-query --show --showformat='${db:Status-Status}' "$1" 2>/dev/null) == installed ]]
}

# Installs those of PACKAGES that are not installed, in one apt transaction, as cloud-init would: no
# questions, and the configuration files written before kept (--force-confold: Prometheus's, Slurm's).
# shellcheck disable=SC2317  # run through step, which shellcheck cannot follow
install_packages() {
  local package missing=()
  for package in "${PACKAGES[@]}"; do
    is_installed "${package%%=*}" || missing+=("$package")
  done
  ((${#missing[@]} > 0)) || return 0
  log "installing ${missing[*]}"
  # A failed update need not fail the step: a repository we need nothing from may be down, and the
  # install says whether ours answered.
  apt-get --quiet update || log "apt-get update failed; installing from the lists it has"
  # DPkg::Lock::Timeout: apt's daily jobs may hold the lock at boot.
  DEBIAN_FRONTEND=noninteractive apt-get --quiet --assume-yes --option=DPkg::Lock::Timeout=600 \
    --option=Dpkg::Options::=--force-confold install "${missing[@]}"
}
