#!/usr/bin/env python3
"""The cluster's users list, kept by the head node: what `dtrain users` reads and changes. Run as root.

Runs on the login node (stdlib only), sent on stdin by the admin's `dtrain users` over SSH:

  python3 - show USERS_DIR [--fresh-s S]
  python3 - add USERS_DIR --entry JSON
  python3 - remove USERS_DIR NAME [--slurm-conf FILE]
  python3 - limit USERS_DIR NAME --set JSON [--clear]
  python3 - limit-account USERS_DIR ACCOUNT --set JSON [--clear]

USERS_DIR (<shared>/.users) holds users.json (root's, 0644: names, uids, public keys, Slurm accounts,
limits, and the limits of whole accounts) and applied/<host>, each host's report of the list it applied
last (apply_users.py). Changes are made under an flock of USERS_DIR/.lock and written whole (a temporary
file renamed), so that the hosts never read half a list. `add` gives the person the lowest free uid from
FIRST_UID; `remove` first cancels the person's jobs (an account that is gone can run none; their run
directories stay); `limit` sets the limits --set names (JSON, as infra/users.py's UserLimits dumps them),
every other one dropped first with --clear (the head's apply-users makes Slurm's association follow);
`limit-account` the same for an account that a person of the list is in (infra/users.py's AccountLimits).
Prints one JSON document: the list, its digest, and the hosts' reports (with their age in seconds, and
whether it is fresh, younger than --fresh-s: a host that stopped reporting is off). Exit status 0; 2 for
a name already in the list (add) or not in it (remove, limit), or an account no one of the list is in
(limit-account).
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
    """The list as a document ({"users": [...], "accounts": {...}}, `accounts` only where one has limits), and
    its digest."""
    try:
        with open(os.path.join(users_dir, LIST_FILE), "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        return {"users": []}, hashlib.sha256(b"").hexdigest()
    return json.loads(data), hashlib.sha256(data).hexdigest()


def write(users_dir, document):
    """The list, whole (as infra/users.py's UsersList.document writes it); its digest (what the hosts'
    reports name once they have applied it)."""
    if not document.get("accounts"):
        document = {"users": document["users"]}
    data = (json.dumps(document, indent=2, sort_keys=True) + "\n").encode()
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


def updated(limits, given, clear):
    """limits (a dict) with given's set, every other one dropped first where clear."""
    return dict(given) if clear else dict(limits or {}, **given)


def change(args):
    """add, remove, limit or limit-account under the lock; the exit status."""
    document, _ = read(args.users_dir)
    users = document["users"]
    names = [user["name"] for user in users]
    if args.action == "add":
        entry = json.loads(args.entry)
        if entry["name"] in names:
            print(f"{entry['name']} is already in the list", file=sys.stderr)
            return EXIT_BAD_INPUT
        entry["uid"] = free_uid(users)
        users.append(entry)
        write(args.users_dir, document)
        return 0
    if args.action == "limit-account":
        accounts = document.setdefault("accounts", {})
        if args.account not in {user["account"] for user in users}:
            print(f"no one in the list is in the account {args.account}", file=sys.stderr)
            return EXIT_BAD_INPUT
        accounts[args.account] = updated(accounts.get(args.account), json.loads(args.set), args.clear)
        if not accounts[args.account]:
            del accounts[args.account]
        write(args.users_dir, document)
        return 0
    if args.name not in names:
        print(f"{args.name} is not in the list", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.action == "limit":
        user = users[names.index(args.name)]
        user["limits"] = updated(user.get("limits"), json.loads(args.set), args.clear)
    else:
        cancel_jobs(args.name, args.slurm_conf)
        users.pop(names.index(args.name))
    write(args.users_dir, document)
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="users_list.py", description=__doc__.splitlines()[0])
    actions = parser.add_subparsers(dest="action", required=True)
    for action in ("show", "add", "remove", "limit", "limit-account"):
        sub = actions.add_parser(action)
        sub.add_argument("users_dir")
        sub.add_argument("--fresh-s", type=float, default=90.0, help="a report older than this is a host that is off")
    actions.choices["add"].add_argument("--entry", required=True, help="the person, as JSON (without uid)")
    actions.choices["remove"].add_argument("name")
    actions.choices["remove"].add_argument("--slurm-conf", help="SLURM_CONF for scancel (default: Slurm's)")
    actions.choices["limit"].add_argument("name")
    actions.choices["limit-account"].add_argument("account")
    for action in ("limit", "limit-account"):
        actions.choices[action].add_argument("--set", required=True, help="the limits to set, as JSON")
        actions.choices[action].add_argument("--clear", action="store_true", help="drop every other limit first")
    args = parser.parse_args(argv)
    status = 0
    if args.action != "show":
        os.makedirs(args.users_dir, mode=0o755, exist_ok=True)
        with open(os.path.join(args.users_dir, LOCK_FILE), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            status = change(args)
    document, digest = read(args.users_dir)
    json.dump(dict(document, digest=digest, reports=reports(args.users_dir, args.fresh_s)), sys.stdout)
    return status


if __name__ == "__main__":
    sys.exit(main())
