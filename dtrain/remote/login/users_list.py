#!/usr/bin/env python3
"""The cluster's users list, kept by the head node: what `dtrain users` reads and changes. Run as root.

Runs on the login node (stdlib only), sent on stdin by the admin's `dtrain users` over SSH:

  python3 - show USERS_DIR [--fresh-s S]
  python3 - add USERS_DIR --entry JSON
  python3 - remove USERS_DIR NAME [--slurm-conf FILE]
  python3 - limit USERS_DIR NAME --set JSON [--clear]

USERS_DIR (<shared>/.users) holds users.json (root's, 0644: names, uids, public keys, Slurm accounts,
limits) and applied/<host>, each host's report of the list it applied last (apply_users.py). Changes are
made under an flock of USERS_DIR/.lock and written whole (a temporary file renamed), so that the hosts
never read half a list. `add` gives the person the lowest free uid from FIRST_UID; `remove` first
cancels the person's jobs (an account that is gone can run none; their run directories stay); `limit`
sets the limits --set names (JSON, as infra/users.py's UserLimits dumps them), every other one dropped
first with --clear (the head's apply-users makes Slurm's association follow). Prints one JSON document:
the list, its digest, and the hosts' reports (with their age in seconds, and whether it is fresh, younger
than --fresh-s: a host that stopped reporting is off). Exit status 0; 2 for a name already in the list
(add) or not in it (remove, limit).
"""

import argparse
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import time

FIRST_UID, LAST_UID = 20000, 59999  # infra/users.py's
LIST_FILE, APPLIED_DIR, LOCK_FILE = "users.json", "applied", ".lock"
EXIT_BAD_INPUT = 2


def read(users_dir):
    try:
        with open(os.path.join(users_dir, LIST_FILE), "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        return [], hashlib.sha256(b"").hexdigest()
    return json.loads(data)["users"], hashlib.sha256(data).hexdigest()


def write(users_dir, users):
    """The list, whole; its digest (what the hosts' reports name once they have applied it)."""
    data = (json.dumps({"users": users}, indent=2, sort_keys=True) + "\n").encode()
    path = os.path.join(users_dir, LIST_FILE)
    partial = f"{path}.{os.getpid()}.tmp"
    with open(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), "wb") as handle:
        handle.write(data)
    os.chmod(partial, 0o644)
    os.replace(partial, path)
    return hashlib.sha256(data).hexdigest()


def reports(users_dir, fresh_s):
    found = {}
    directory = os.path.join(users_dir, APPLIED_DIR)
    for host in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        try:
            with open(os.path.join(directory, host)) as handle:
                report = json.load(handle)
        except (OSError, ValueError):
            continue  # being written
        age = time.time() - float(report.get("applied_at", 0))
        found[host] = {"digest": report.get("digest"), "errors": report.get("errors", []), "age_s": round(age, 1)}
        found[host]["fresh"] = age <= fresh_s
    return found


def free_uid(users):
    taken = {user["uid"] for user in users}
    return next(uid for uid in range(FIRST_UID, LAST_UID + 1) if uid not in taken)


def cancel_jobs(name, slurm_conf):
    env = dict(os.environ, **({"SLURM_CONF": slurm_conf} if slurm_conf else {}))
    proc = subprocess.run(["scancel", "--user", name], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"users: scancel --user {name}: {proc.stderr.strip()}", file=sys.stderr)


def change(args):
    """add, remove or limit under the lock; the exit status."""
    users, _ = read(args.users_dir)
    names = [user["name"] for user in users]
    if args.action == "add":
        entry = json.loads(args.entry)
        if entry["name"] in names:
            print(f"{entry['name']} is already in the list", file=sys.stderr)
            return EXIT_BAD_INPUT
        entry["uid"] = free_uid(users)
        users.append(entry)
        write(args.users_dir, users)
        return 0
    if args.name not in names:
        print(f"{args.name} is not in the list", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.action == "limit":
        user = users[names.index(args.name)]
        limits = {} if args.clear else dict(user.get("limits") or {})
        limits.update(json.loads(args.set))
        user["limits"] = limits
    else:
        cancel_jobs(args.name, args.slurm_conf)
        users.pop(names.index(args.name))
    write(args.users_dir, users)
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="users_list.py", description=__doc__.splitlines()[0])
    actions = parser.add_subparsers(dest="action", required=True)
    for action in ("show", "add", "remove", "limit"):
        sub = actions.add_parser(action)
        sub.add_argument("users_dir")
        sub.add_argument("--fresh-s", type=float, default=90.0, help="a report older than this is a host that is off")
    actions.choices["add"].add_argument("--entry", required=True, help="the person, as JSON (without uid)")
    actions.choices["remove"].add_argument("name")
    actions.choices["remove"].add_argument("--slurm-conf", help="SLURM_CONF for scancel (default: Slurm's)")
    actions.choices["limit"].add_argument("name")
    actions.choices["limit"].add_argument("--set", required=True, help="the limits to set, as JSON")
    actions.choices["limit"].add_argument("--clear", action="store_true", help="drop every other limit first")
    args = parser.parse_args(argv)
    status = 0
    if args.action != "show":
        os.makedirs(args.users_dir, mode=0o755, exist_ok=True)
        with open(os.path.join(args.users_dir, LOCK_FILE), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            status = change(args)
    users, digest = read(args.users_dir)
    json.dump({"users": users, "digest": digest, "reports": reports(args.users_dir, args.fresh_s)}, sys.stdout)
    return status


if __name__ == "__main__":
    sys.exit(main())
