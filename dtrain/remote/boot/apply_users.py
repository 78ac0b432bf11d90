#!/usr/bin/env python3
"""apply-users: make this host's accounts what the cluster's users list says. Idempotent; run as root.

Standard library only, Python 3.8+. On Azure every host runs it from dtrain-users.timer (every 30 s,
and once at boot before slurmd); on the local cluster a loop runs it inside each emulated host.

  apply-users --list /shared/.users/users.json --host NAME --home-root /shared/home \\
      [--make-homes] [--team-dir /shared/runs ...] [--report-dir /shared/.users/applied] [--shell SHELL] \\
      [--slurm-users /var/lib/dtrain-users/slurm-users]

For every person of the list: a group and an account with the list's uid (the same on every host: NFS
needs it), the marker ACCOUNT_MARKER in its comment (what this tool may remove later), no password but
not locked (sshd refuses a locked account), home HOME_ROOT/NAME (made 0700 where --make-homes, on the
host that keeps the list), and their public key in KEYS_DIR/NAME, where sshd reads it. For every account
with the marker that the list no longer names: its key goes (no new login), its sessions end (logind's
terminate-user; without logind, every process of its uid in this host's mount namespace), and the
account goes, home and files kept (its runs stay on the shared file system). An account of the host's
own is never taken over or removed, and a uid another account holds is refused: each is an error.

--slurm-users (the head node, where slurmdbd runs): Slurm's associations follow the list too, through
sacctmgr: each person a user of their account (made under root where missing) with the list's limits
(LIMITS: MaxJobs, MaxNodes per job, GrpTRES gres/gpu for all their running jobs together, GrpTRESMins
gres/gpu for their GPU-hour budget, in GPU-minutes), and each account of the list's people with the
list's account limits (GrpTRES and GrpTRESMins over all its members' jobs; an account the list no longer
limits is cleared); a person the list no longer names is removed from Slurm, their jobs' records kept.
The file names the people this tool made in Slurm, the ones it may remove: the admin user and root are
never touched.

--team-dir: where every person must be able to make their own entries (runs/, the dataset area): made
1777 (sticky, as /tmp: each entry is its maker's) once the list names anyone. Where the list's directory
is not there (the shared file system not mounted, or the head node not set up yet) nothing changes, and
that is no fault. Each run writes REPORT_DIR/HOST (the digest of the list it applied, when, and its
errors: what `dtrain users` waits for). Exit status 0, or 1 when anything could not be applied (each
reason on stderr).
"""

import argparse
import contextlib
import grp
import hashlib
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import time

# infra/users.py holds these for the operator's side; tests/scripts/test_users.py checks they agree.
KEYS_DIR = "/etc/ssh/dtrain-users"
ACCOUNT_MARKER = "dtrain user"
FIRST_UID, LAST_UID = 20000, 59999
USER_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
KILL_ROUNDS = 5  # a process may fork while its siblings are killed: look again


GPU_TRES = "gres/gpu"
NO_LIMIT = "-1"  # sacctmgr's, for a count and for one TRES of a list (a bare -1 there is refused)


def gpu_minutes(hours):
    """A GPU-hour budget as GrpTRESMins counts it: whole GPU-minutes, the nearest (infra/users.py's)."""
    return round(hours * 60)


# The list's limits (infra/users.py's UserLimits) -> the association's setting, and the value sacctmgr takes
# and shows for it: a count, or the GPUs' item of a TRES list (GrpTRES=gres/gpu=8)
LIMITS = {
    "max_jobs": ("MaxJobs", str),
    "max_nodes": ("MaxNodes", str),
    "max_gpus": ("GrpTRES", f"{GPU_TRES}={{}}".format),
    "gpu_hours": ("GrpTRESMins", lambda hours: f"{GPU_TRES}={gpu_minutes(hours)}"),
}
TRES_SETTINGS = ("GrpTRES", "GrpTRESMins")
ACCOUNT_LIMITS = ("max_gpus", "gpu_hours")  # what the list may limit of a whole account (AccountLimits)


def log(message):
    print(f"apply-users: {message}", file=sys.stderr)


def read_list(path):
    """(users, accounts' limits, digest) of the list at path; an absent file is an empty list. Raises
    ValueError when the file is not a list of users this tool can apply."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        return [], {}, hashlib.sha256(b"").hexdigest()
    document = json.loads(data)
    users = document.get("users") if isinstance(document, dict) else None
    if not isinstance(users, list):
        raise ValueError("it has no list of users")
    accounts = document.get("accounts", {})
    if not (isinstance(accounts, dict) and all(isinstance(limits, dict) for limits in accounts.values())):
        raise ValueError("its accounts are not a map of limits")
    for user in users:
        name, uid, key = user.get("name"), user.get("uid"), user.get("ssh_public_key")
        if not (isinstance(name, str) and USER_NAME.fullmatch(name)):
            raise ValueError(f"user name {name!r} is invalid")
        if not (type(uid) is int and FIRST_UID <= uid <= LAST_UID):
            raise ValueError(f"uid {uid!r} of {name} is not between {FIRST_UID} and {LAST_UID}")
        if not (isinstance(key, str) and key.strip() and "\n" not in key.strip()):
            raise ValueError(f"the key of {name} is not one line")
    return users, accounts, hashlib.sha256(data).hexdigest()


def run(argv):
    """argv's exit status; its stderr's last line logged when it failed."""
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        log(f"{' '.join(argv)}: {(proc.stderr.strip().splitlines() or ['failed'])[-1]}")
    return proc.returncode


def account(name):
    try:
        return pwd.getpwnam(name)
    except KeyError:
        return None


def write_file(path, text, mode):
    """path holds text (mode), written whole or not at all; untouched when it already does."""
    try:
        with open(path) as handle:
            if handle.read() == text and (os.stat(path).st_mode & 0o7777) == mode:
                return
    except OSError:
        pass
    partial = f"{path}.{os.getpid()}.tmp"
    with open(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "w") as handle:
        handle.write(text)
    os.chmod(partial, mode)
    os.replace(partial, path)


def ensure_user(user, home_root, make_homes, keys_dir, shell):
    """The person's group, account, home and key; returns the errors."""
    name, uid = user["name"], user["uid"]
    home = os.path.join(home_root, name)
    existing = account(name)
    if existing is not None and existing.pw_gecos != ACCOUNT_MARKER:
        return [f"{name} is an account of this host's own: not taken over"]
    if existing is not None and existing.pw_uid != uid:
        return [f"{name} has uid {existing.pw_uid} here, the list says {uid}: not changed"]
    if existing is None:
        try:
            return [f"uid {uid} of {name} belongs to {pwd.getpwuid(uid).pw_name} here"]
        except KeyError:
            pass
        try:
            holder = grp.getgrgid(uid).gr_name
        except KeyError:
            holder = None
        if holder not in (None, name):
            return [f"gid {uid} of {name} belongs to the group {holder} here"]
        if holder is None and run(["groupadd", "--gid", str(uid), name]) != 0:
            return [f"could not make the group {name}"]
        useradd = ["useradd", "--uid", str(uid), "--gid", str(uid), "--no-create-home", "--home-dir", home]
        # '*': no password, and not locked ('!'), which sshd refuses without PAM (the local cluster)
        useradd += ["--shell", shell, "--comment", ACCOUNT_MARKER, "--password", "*", name]
        if run(useradd) != 0:
            return [f"could not make the account {name}"]
        log(f"added {name} (uid {uid})")
    if make_homes and not os.path.isdir(home):
        os.makedirs(home_root, mode=0o755, exist_ok=True)
        os.mkdir(home, 0o700)
        os.chown(home, uid, uid)
        os.chmod(home, 0o700)
    write_file(os.path.join(keys_dir, name), user["ssh_public_key"].strip() + "\n", 0o644)
    return []


def remove_user(entry, keys_dir):
    """The account's key, sessions and account (its home and files stay); returns the errors."""
    name = entry.pw_name
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(keys_dir, name))  # first: no new login from here on
    end_sessions(name, entry.pw_uid)
    # --force: even where a process of it outlived the sessions (a job's, in a container's namespace)
    if run(["userdel", "--force", name]) != 0:
        return [f"could not remove the account {name}"]
    try:
        grp.getgrnam(name)
        run(["groupdel", name])
    except KeyError:
        pass
    log(f"removed {name} (uid {entry.pw_uid}); its files are kept")
    return []


def end_sessions(name, uid):
    if os.path.isdir("/run/systemd/system") and shutil.which("loginctl"):
        subprocess.run(["loginctl", "terminate-user", name], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return
    for _ in range(KILL_ROUNDS):
        if not kill_processes(uid):
            return
        time.sleep(0.1)


def kill_processes(uid):
    """SIGKILL every process of uid in this mount namespace (this host's, where hosts are namespaces);
    whether there was any."""
    own = os.readlink("/proc/self/ns/mnt")
    found = False
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as handle:
                uids = next(line.split()[1:3] for line in handle if line.startswith("Uid:"))
            if str(uid) not in uids or os.readlink(f"/proc/{entry}/ns/mnt") != own:
                continue
            os.kill(int(entry), signal.SIGKILL)
            found = True
        except (OSError, StopIteration):
            continue  # gone meanwhile
    return found


def open_team_dirs(paths):
    errors = []
    for path in paths:
        try:
            os.makedirs(path, exist_ok=True)
            if os.stat(path).st_mode & 0o7777 != 0o1777:
                os.chmod(path, 0o1777)
        except OSError as exc:
            errors.append(f"could not open {path} to every user: {exc.strerror}")
    return errors


def apply(users, args):
    wanted = {user["name"] for user in users}
    errors = []
    os.makedirs(args.keys_dir, mode=0o755, exist_ok=True)
    for entry in pwd.getpwall():
        if entry.pw_gecos == ACCOUNT_MARKER and entry.pw_name not in wanted:
            errors += remove_user(entry, args.keys_dir)
    for user in users:
        errors += ensure_user(user, args.home_root, args.make_homes, args.keys_dir, args.shell)
    if users:
        errors += open_team_dirs(args.team_dir)
    return errors


def sacctmgr(*words):
    """sacctmgr's parsable rows (`show`) or its exit status, with its complaint logged (changes)."""
    argv = ["sacctmgr", "--immediate", "--noheader", "--parsable2", *words]
    if words[0] == "show":
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0:
            raise OSError(f"sacctmgr {' '.join(words)}: {(proc.stderr.strip().splitlines() or ['failed'])[-1]}")
        return [line.split("|") for line in proc.stdout.splitlines() if line]
    return run(argv)


def wanted_limits(given, keys=tuple(LIMITS)):
    """The association settings the list's limits (a person's, or an account's: keys) ask for: each set or
    cleared (None)."""
    given = given or {}
    return {LIMITS[key][0]: None if given.get(key) is None else LIMITS[key][1](given[key]) for key in keys}


def set_limit(setting, value):
    """`Setting=value` for sacctmgr; value None clears it."""
    if value is None:
        value = f"{GPU_TRES}={NO_LIMIT}" if setting in TRES_SETTINGS else NO_LIMIT
    return f"{setting}={value}"


def limit_now(setting, shown):
    """What of an association's setting (sacctmgr's text) the list governs: the GPUs' item of a TRES list (an
    admin's own limit on another TRES stays), or the count; None where there is no limit."""
    if setting in TRES_SETTINGS:
        shown = next((item for item in shown.split(",") if item.startswith(f"{GPU_TRES}=")), "")
    return shown or None


def apply_slurm_users(users, account_limits, made_path):
    """Slurm's associations as the list says; returns the errors (slurmdbd down: one, retried next run)."""
    try:
        with open(made_path) as handle:
            made = set(handle.read().split())
    except FileNotFoundError:
        made = set()
    try:
        accounts = {row[0] for row in sacctmgr("show", "account", "format=account")}
        columns = [setting for setting, _ in LIMITS.values()]
        rows = sacctmgr("show", "association", f"format=user,account,{','.join(columns)}")
        defaults = dict(sacctmgr("show", "user", "format=user,defaultaccount"))
    except OSError as exc:
        return [f"Slurm's associations not applied: {exc}"]
    current = {(row[0], row[1]): {c: row[2 + i] for i, c in enumerate(columns)} for row in rows}
    errors = []
    for name in sorted({user["account"] for user in users} - accounts):
        if sacctmgr("add", "account", name, f"Description={name}", f"Organization={name}", "Parent=root"):
            errors.append(f"could not make the Slurm account {name}")
        else:  # made without limits: the list's are set next
            current[("", name)] = {setting: "" for setting in columns}
    errors += apply_account_limits({user["account"] for user in users}, account_limits, current)
    current = {pair: settings for pair, settings in current.items() if pair[0]}
    for user in users:
        name, account_name, limits = user["name"], user["account"], wanted_limits(user.get("limits"))
        have = current.get((name, account_name))
        if have is None:
            settings = [set_limit(setting, value) for setting, value in limits.items() if value is not None]
            if sacctmgr("add", "user", name, f"Account={account_name}", f"DefaultAccount={account_name}", *settings):
                errors.append(f"could not make {name} a Slurm user of {account_name}")
                continue
            log(f"{name}: a Slurm user of {account_name}")
        else:
            changed = [
                set_limit(setting, value)
                for setting, value in limits.items()
                if limit_now(setting, have[setting]) != value
            ]
            if changed and sacctmgr(
                "modify", "user", "where", f"name={name}", f"account={account_name}", "set", *changed
            ):
                errors.append(f"could not set the limits of {name}")
        if defaults.get(name, account_name) != account_name and sacctmgr(
            "modify", "user", "where", f"name={name}", "set", f"DefaultAccount={account_name}"
        ):
            errors.append(f"could not make {account_name} the default account of {name}")
        stale = [acct for (who, acct) in current if who == name and acct != account_name]
        for acct in stale:  # moved to another account: the old one's association goes
            sacctmgr("remove", "user", "where", f"name={name}", f"account={acct}")
        made.add(name)
    wanted = {user["name"] for user in users}
    for name in sorted(made - wanted):
        if any(who == name for who, _ in current) and sacctmgr("remove", "user", "where", f"name={name}"):
            errors.append(f"could not remove {name} from Slurm (running jobs end first)")
            continue
        made.discard(name)
        log(f"{name}: no longer a Slurm user; the records of their jobs are kept")
    write_file(made_path, "".join(f"{name}\n" for name in sorted(made)), 0o644)
    return errors


def apply_account_limits(names, account_limits, current):
    """The accounts' own associations (current's rows with no user) as the list limits them, for the accounts
    its people are in (names): an account the list does not limit is cleared. The errors."""
    errors = []
    for name in sorted(names):
        have = current.get(("", name))
        if have is None:
            continue  # not made: said above
        limits = wanted_limits(account_limits.get(name), ACCOUNT_LIMITS)
        changed = [set_limit(s, value) for s, value in limits.items() if limit_now(s, have[s]) != value]
        if changed and sacctmgr("modify", "account", "where", f"name={name}", "set", *changed):
            errors.append(f"could not set the limits of the account {name}")
        elif changed:
            log(f"the account {name}: {' '.join(changed)}")
    return errors


def write_report(report_dir, host, digest, errors):
    os.makedirs(report_dir, mode=0o755, exist_ok=True)
    report = {"host": host, "digest": digest, "applied_at": time.time(), "errors": errors}
    write_file(os.path.join(report_dir, host), json.dumps(report) + "\n", 0o644)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="apply-users", description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", required=True, help="the users list (users.json)")
    parser.add_argument("--host", required=True, help="this host's name in the reports")
    parser.add_argument("--home-root", required=True, help="where the homes are: HOME_ROOT/NAME")
    parser.add_argument("--make-homes", action="store_true", help="make a missing home (0700, the person's)")
    parser.add_argument("--team-dir", action="append", default=[], help="made 1777 once the list names anyone")
    parser.add_argument("--report-dir", help="where this host's report goes (default: none)")
    parser.add_argument("--keys-dir", default=KEYS_DIR, help=f"where sshd reads the keys ({KEYS_DIR})")
    parser.add_argument("--shell", default="/bin/bash", help="the accounts' login shell (/bin/bash)")
    parser.add_argument(
        "--slurm-users", metavar="FILE", help="also apply Slurm's associations; FILE keeps the people made there"
    )
    args = parser.parse_args(argv)
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.list))):
        # not a fault: the head node has not made it yet (a node's first boot may come first); never an
        # empty list either, which would remove everyone while the shared file system is not mounted
        log(f"{os.path.dirname(args.list)} is not there yet: nothing to apply, nothing changed")
        return 0
    try:
        users, account_limits, digest = read_list(args.list)
    except (OSError, ValueError) as exc:
        log(f"cannot read {args.list}: {exc}: nothing changed")
        return 1
    errors = apply(users, args)
    if args.slurm_users:
        errors += apply_slurm_users(users, account_limits, args.slurm_users)
    for error in errors:
        log(error)
    if args.report_dir:  # named as Slurm names a node: Azure may write a host name's digits in upper case
        write_report(args.report_dir, args.host.lower(), digest, errors)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
