"""A cluster a team shares, on the local cluster's real sshds, Slurm and shared directory: two people,
alice and bob, added with `users add` by the admin, each with their own key and description. Every host
(head, NFS server, nodes: each with its own /etc) gives them the same uid; their jobs run as them; each
one's run directory, secrets and checkpoints are theirs alone, and Slurm refuses to cancel another's job;
`users remove` ends bob's logins and keeps his runs."""

from __future__ import annotations

import json
import pwd
import shutil
import stat
import subprocess
import tempfile
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from dtrain.cluster import users as cluster_users
from dtrain.cluster.description import ClusterDescription, load
from dtrain.cluster.limits import AccountStanding, Standing, budget_warning, held, read_standings
from dtrain.cluster.slurm import Slurm
from dtrain.cluster.ssh import SSH, SSHFailure
from dtrain.json_documents import UsageCostDocument
from dtrain.local import accounts as local_accounts
from dtrain.local import cluster as local_cluster
from dtrain.local.nodes import keygen
from dtrain.local.state import LocalState, load_state
from dtrain.remote.boot import apply_users
from dtrain.remote.login import users_list
from infra import users as infra_users
from infra.cloud_init.slurm import PRIORITY_CALC_PERIOD_MIN
from tests.polling import wait_for

from .conftest import cluster_name, free_subnet, leftovers, run_module, slurm_command

JOB = """import os, sys, time
os.makedirs(os.environ["CHECKPOINT_DIR"], exist_ok=True)
with open(os.path.join(os.environ["CHECKPOINT_DIR"], "step-1.pt"), "w") as out:
    out.write("weights")
print("running as uid", os.getuid(), flush=True)
time.sleep(float(sys.argv[1]))
"""
HOSTS = ("head", "nfs", "node-0", "node-1")  # the local cluster's: head is also the login and jump host
# a change of the list reaches every host within the CLI's own wait; a session ends on the same round
APPLIED_S = cluster_users.APPLY_WAIT_S + 30


@dataclass(frozen=True)
class Team:
    state: Path
    admin: Path  # the admin's description
    people: dict[str, Path]  # name -> their description
    code: Path  # the job everyone launches (--workdir)


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return run_module("dtrain", *args, env=env, timeout=300)


@pytest.fixture(scope="module")
def team() -> Iterator[Team]:
    """A cluster of its own, in a directory every user may traverse (the shared homes and runs are below
    it), with alice and bob added by the admin."""
    machine = Path(tempfile.mkdtemp(prefix="dtrain-users-", dir="/tmp"))
    machine.chmod(0o755)
    state, name = machine / "cluster", cluster_name("u")
    # two GPUs a node (emulated, dtrain/local/gpus.py): the people's GPU limits and budgets have GPUs to count
    local_cluster.up(nodes=2, state_dir=state, name=name, subnet=free_subnet(), gpus_per_node=2)
    try:
        admin, people = state / "cluster.json", {}
        keys = machine / "keys"
        for person, account in (("alice", "vision"), ("bob", "nlp")):
            keygen(keys / person, person)
            added = cli("users", "add", person, "--ssh-key", f"{keys / person}.pub", "--account", account,
                        "--cluster", str(admin))  # fmt: skip
            assert added.returncode == 0, added.stderr
            people[person] = machine / f"{person}.json"
            described = cli("cluster", "for-user", person, "--ssh-key", str(keys / person), "-o",
                            str(people[person]), "--cluster", str(admin))  # fmt: skip
            assert described.returncode == 0, described.stderr
        code = machine / "code"
        code.mkdir()
        (code / "job.py").write_text(JOB)
        yield Team(state, admin, people, code)
    finally:
        local_cluster.down(state, quiet=True)
        assert leftovers(state, name) == []
        shutil.rmtree(machine, ignore_errors=True)


def accounts(team: Team, host: str) -> dict[str, int]:
    """name -> uid of the people's accounts on a host (its own /etc)."""
    passwd = (local_accounts.etc_dir(_state(team), host) / "passwd").read_text().splitlines()
    fields = [line.split(":") for line in passwd]
    return {f[0]: int(f[2]) for f in fields if len(f) > 4 and f[4] == infra_users.ACCOUNT_MARKER}


def _state(team: Team) -> LocalState:
    state = load_state(team.state)
    assert state is not None
    return state


def launch(team: Team, person: str, run_id: str, seconds: float, *extra: str) -> subprocess.CompletedProcess:
    return cli("launch", "--cluster", str(team.people[person]), "--workdir", str(team.code), "--mode", "per-node",
               "--run-id", run_id, "--detach", *extra, "--", "python3", "job.py", str(seconds),
               env={"TEAM_TOKEN": f"{person}-secret"})  # fmt: skip


def job_id(team: Team, run_id: str) -> str:
    return (team.state / "shared" / "runs" / run_id / "job_id").read_text().strip()


def test_the_host_tools_repeat_the_users_contract():
    """apply_users.py and users_list.py stand alone on the hosts (stdlib only): their copies of infra/users.py."""
    assert (apply_users.KEYS_DIR, apply_users.ACCOUNT_MARKER) == (infra_users.KEYS_DIR, infra_users.ACCOUNT_MARKER)
    for tool in (apply_users, users_list):
        assert (tool.FIRST_UID, tool.LAST_UID) == (infra_users.FIRST_UID, infra_users.LAST_UID)
    assert apply_users.USER_NAME.pattern == infra_users.USER_NAME.pattern
    for hours in (0.01, 0.5, 2.5 / 60, 0.1, 1000):  # a budget in the GPU-minutes of GrpTRESMins
        assert apply_users.gpu_minutes(hours) == infra_users.gpu_minutes(hours), hours
    assert (users_list.LIST_FILE, users_list.APPLIED_DIR) == (infra_users.LIST_FILE, infra_users.APPLIED_DIR)


def apply_on_a_host(etc: Path, listed: Path, *, home_root: Path) -> subprocess.CompletedProcess:
    """apply_users.py as a host runs it, in a mount namespace of its own whose /etc is etc."""
    script = f'mount --bind {etc} /etc && exec "$@"'
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "apply-users", "python3"]
    argv += [apply_users.__file__, "--list", str(listed), "--host", "HOST-1", "--home-root", str(home_root)]
    return subprocess.run([*argv, "--report-dir", str(listed.parent / "applied")], capture_output=True, text=True)


def test_a_host_keeps_its_own_accounts_and_uids_and_changes_nothing_without_the_list(tmp_path: Path):
    etc = tmp_path / "etc"
    shutil.copytree("/etc", etc, symlinks=True, ignore=shutil.ignore_patterns("netns"))
    with (etc / "passwd").open("a") as passwd:  # the host's own: a daemon named like a person, and a uid
        passwd.write("carol:x:20001:20001::/nonexistent:/usr/sbin/nologin\n")
    listed = tmp_path / "shared" / ".users" / "users.json"
    gone = apply_on_a_host(etc, listed, home_root=tmp_path / "home")  # the head has not made it yet
    assert gone.returncode == 0 and "nothing to apply" in gone.stderr, gone.stderr
    assert (etc / "passwd").read_text().count("\n") == Path("/etc/passwd").read_text().count("\n") + 1
    listed.parent.mkdir(parents=True)
    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAICHiciy4XhgASnQLNQu9REA9Z4xd+o87DSNsT2dz3c2m x"
    users = [{"name": name, "uid": uid, "ssh_public_key": key, "account": "a"} for name, uid in
             (("carol", 20002), ("dave", 20001), ("erin", 20003))]  # fmt: skip
    listed.write_text(json.dumps({"users": users}))
    applied = apply_on_a_host(etc, listed, home_root=tmp_path / "home")
    assert applied.returncode == 1
    report = json.loads((listed.parent / "applied" / "host-1").read_text())  # a node's name, as Slurm's
    assert report["errors"] == [
        "carol is an account of this host's own: not taken over",
        "uid 20001 of dave belongs to carol here",
    ]
    assert "erin:x:20003:20003:dtrain user:" in (etc / "passwd").read_text()  # the others are applied
    assert (etc / "ssh" / "dtrain-users" / "erin").read_text() == key + "\n"


def test_a_person_has_the_same_uid_on_every_host_and_this_machine_none(team: Team):
    seen = {host: accounts(team, host) for host in HOSTS}
    assert seen["head"].keys() == {"alice", "bob"}
    assert all(found == seen["head"] for found in seen.values()), seen
    assert len(set(seen["head"].values())) == 2
    with pytest.raises(KeyError):  # the hosts' accounts are theirs: this machine's /etc is untouched
        pwd.getpwnam("alice")
    # and the account answers on a node, over SSH with alice's own key and description
    alice = load(team.people["alice"])
    with SSH(alice) as ssh:
        answer = ssh.run(ssh.node("node-1"), "id -u; echo $HOME").stdout.split()
    assert answer == [str(seen["node-1"]["alice"]), f"{team.state}/shared/home/alice"]
    home = team.state / "shared" / "home" / "alice"
    assert (home.stat().st_uid, stat.S_IMODE(home.stat().st_mode)) == (seen["head"]["alice"], 0o700)


def test_each_person_works_as_themselves_and_cannot_reach_anothers_run(team: Team):
    uid = accounts(team, "head")
    alice_run = launch(team, "alice", "alice-run", 600, "--secret", "TEAM_TOKEN")
    bob_run = launch(team, "bob", "bob-run", 0)
    assert alice_run.returncode == 0 and bob_run.returncode == 0, alice_run.stderr + bob_run.stderr
    run_dir = team.state / "shared" / "runs" / "alice-run"
    checkpoint = run_dir / "checkpoints" / "step-1.pt"
    wait_for(checkpoint.exists, 120, "alice's job to write its checkpoint", interval=0.5)
    for path in (run_dir, run_dir / "checkpoints", run_dir / "secrets"):
        assert (path.stat().st_uid, stat.S_IMODE(path.stat().st_mode)) == (uid["alice"], 0o700), path
    assert checkpoint.stat().st_uid == uid["alice"] and "running as uid" in (run_dir / "output.log").read_text()
    assert f"running as uid {uid['alice']}" in (run_dir / "output.log").read_text()

    bob = load(team.people["bob"])
    with SSH(bob) as ssh:  # the file system refuses bob alice's files
        for path in (run_dir / "job.json", checkpoint, run_dir / "secrets" / "env"):
            read = ssh.run(ssh.login, f"cat {path}", check=False)
            assert read.returncode != 0 and "Permission denied" in read.stderr, path
    alice_job = job_id(team, "alice-run")
    for command in (("logs", "alice-run"), ("logs", alice_job), ("cancel", alice_job), ("cancel", "alice-run")):
        refused = cli(*command, "--cluster", str(team.people["bob"]))
        lines = refused.stderr.strip().splitlines()
        assert refused.returncode == 3 and len(lines) == 1 and "alice's" in lines[0], (command, refused.stderr)
    assert "Slurm refuses to cancel it" in refused.stderr and "Access/permission denied" in refused.stderr
    queue = slurm_command(load(team.admin), "squeue", "--noheader", "--format=%i %T", f"--jobs={alice_job}")
    assert queue.stdout.split() == [alice_job, "RUNNING"]  # bob's cancel did nothing

    def rows(person: str, *flags: str) -> list[dict]:
        listed = cli("jobs", "--json", *flags, "--cluster", str(team.people[person]))
        assert listed.returncode == 0, listed.stderr
        return json.loads(listed.stdout)["jobs"]

    wait_for(lambda: any(r["run"] == "bob-run" and not r["in_queue"] for r in rows("bob")), 120, "bob's run to end")
    assert {(r["run"], r["user"]) for r in rows("bob")} == {("bob-run", "bob")}  # his own by default
    everyone = {(r["run"], r["user"], r["state"]) for r in rows("alice", "--all")}
    assert ("alice-run", "alice", "RUNNING") in everyone and ("bob-run", "bob", "UNREADABLE") in everyone
    table = cli("jobs", "--all", "--cluster", str(team.people["alice"]))
    assert " user " in table.stdout and "bob" in table.stdout

    cancelled = cli("cancel", alice_job, "--cluster", str(team.people["alice"]))
    assert cancelled.returncode == 0, cancelled.stderr
    # each person a Slurm user of their own account (the head's apply-users), and each job recorded as theirs
    assert associations(team) == {("alice", "vision"), ("bob", "nlp"), ("root", "dtrain"), ("root", "root")}
    assert {(user, account) for _, user, account in recorded_jobs(team)} >= {("alice", "vision"), ("bob", "nlp")}


def standing(team: Team, person: str) -> Standing:
    """The person's limits and budget as Slurm holds them, read as `launch` reads them (their own description)."""
    desc = load(team.people[person])
    with SSH(desc) as ssh:
        return read_standings(Slurm(desc, ssh))[person]


def limit(team: Team, person: str, *flags: str) -> str:
    """`users limit` by the admin; its report (stderr)."""
    changed = cli("users", "limit", person, *flags, "--cluster", str(team.admin))
    assert changed.returncode == 0, changed.stderr
    return changed.stderr


def held_line(launched: subprocess.CompletedProcess, job: str) -> str:
    """What `launch --detach` said of a job Slurm holds: one line."""
    assert launched.returncode == 0, launched.stderr
    (line,) = [line for line in launched.stderr.splitlines() if line.startswith(f"job {job}: held")]
    return line.removeprefix(f"job {job}: ")


def notes(team: Team, person: str) -> dict[str, str]:
    """run -> the note `jobs --json` gives each of the person's jobs in the queue."""
    listed = cli("jobs", "--json", "--cluster", str(team.people[person]))
    assert listed.returncode == 0, listed.stderr
    return {row["run"]: row["note"] for row in json.loads(listed.stdout)["jobs"] if row["in_queue"]}


def test_a_gpu_limit_and_a_spent_budget_hold_a_persons_jobs_and_say_why(team: Team):
    admin, two = load(team.admin), ("gpu-a", "gpu-b")
    assert "alice's limits: 2 GPUs at once" in limit(team, "alice", "--max-gpus", "2")
    with ThreadPoolExecutor() as pool:  # one GPU each: alice's two, at once
        started = list(pool.map(lambda run: launch(team, "alice", run, 600, "--gpus", "1", "--time", "3"), two))
    assert [proc.returncode for proc in started] == [0, 0], [proc.stderr for proc in started]
    both = [job_id(team, run) for run in two]
    wait_for(lambda: _states(admin, both) == {"RUNNING"}, 120, "alice's two jobs to run", interval=0.5)
    third = launch(team, "alice", "gpu-c", 600, "--gpus", "1")
    reason = "held (AssocGrpGRES): alice's GPU limit (2 GPUs at once) is in use by their running jobs; it starts as"
    assert held_line(third, job_id(team, "gpu-c")).startswith(reason), third.stderr
    assert notes(team, "alice")["gpu-c"].startswith(reason)

    # a budget (6 GPU-minutes) with too little left for a job's time limit x GPUs (2 x 5 minutes): held at once
    # (AccountingStorageEnforce=safe), not started and then killed as the budget runs out
    assert "alice's limits: 0.1 GPU-hours a month" in limit(team, "alice", "--clear", "--gpu-hours", "0.1")
    changes = transactions(admin)  # the head's apply-users changes Slurm only where the list changed
    head_applies(team, rounds=2)
    assert transactions(admin) == changes
    big = launch(team, "alice", "gpu-d", 600, "--gpus", "2", "--time", "5")
    line = held_line(big, job_id(team, "gpu-d"))
    assert line.startswith("held (AssocGrpGRESMinutes): alice's GPU-hour budget has too little left for this job's")
    assert "of 0.10 GPU-hours this month): it may start as their running jobs end, or cancel it and ask" in line

    # Slurm counts the GPU-minutes her jobs hold (tallied every PriorityCalcPeriod, a minute); a budget below
    # them (one GPU-minute) is spent, and her next job waits
    tally_s = PRIORITY_CALC_PERIOD_MIN * 60 + 30 + 60  # the tally, the half minute that makes one, a margin
    wait_for(lambda: standing(team, "alice").used >= 1, tally_s, "alice's GPU-minutes to be counted", interval=2)
    limit(team, "alice", "--gpu-hours", "0.01")
    spent = launch(team, "alice", "gpu-e", 600, "--gpus", "1", "--time", "1")
    line = held_line(spent, job_id(team, "gpu-e"))
    assert line.startswith("held (AssocGrpGRESMinutes): alice's GPU-hour budget is spent (") and " of 0.02 GPU-" in line
    assert notes(team, "alice")["gpu-e"] == line
    assert _states(admin, [job_id(team, "gpu-e")]) == {"PENDING"}
    jobs = [job_id(team, f"gpu-{x}") for x in "abcde"]
    slurm_command(admin, "scancel", *jobs)  # by id: this machine has no alice for `--user` to name
    wait_for(lambda: not _states(admin, jobs), 120, "alice's jobs to end", 0.5)


def test_an_accounts_gpu_limit_holds_its_members_jobs_and_says_whose_limit_it_is(team: Team):
    """`users limit-account`: all of an account's members' jobs together within its cap (the account's own
    association, GrpTRES), whatever each person's own limits; cleared, the held job starts."""
    admin = load(team.admin)
    limit(team, "alice", "--clear")  # the budget the test above spent: only the account's limit holds her now
    changed = cli("users", "limit-account", "vision", "--max-gpus", "1", "--cluster", str(team.admin))
    assert changed.returncode == 0 and "the account vision's limits: 1 GPU at once" in changed.stderr, changed.stderr
    assert "gres/gpu=1" in account_limits(team)["vision"]
    listed = cli("users", "list", "--cluster", str(team.people["bob"]))  # anyone may read the list
    assert listed.returncode == 0 and "vision" in listed.stdout and "1 GPU at once" in listed.stdout, listed.stderr

    first = launch(team, "alice", "acct-a", 600, "--gpus", "1")
    assert first.returncode == 0, first.stderr
    wait_for(lambda: _states(admin, [job_id(team, "acct-a")]) == {"RUNNING"}, 120, "alice's first job", interval=0.5)
    second = launch(team, "alice", "acct-b", 600, "--gpus", "1")
    reason = "held (AssocGrpGRES): the account vision's GPU limit (1 GPU at once, all its members) is in use by"
    assert held_line(second, job_id(team, "acct-b")).startswith(reason), second.stderr
    assert notes(team, "alice")["acct-b"].startswith(reason)

    refused = cli("users", "limit-account", "nope", "--max-gpus", "1", "--cluster", str(team.admin))
    assert (refused.returncode, refused.stderr.strip()) == (2, "error: no one in the list is in the account nope")
    cleared = cli("users", "limit-account", "vision", "--clear", "--cluster", str(team.admin))
    assert cleared.returncode == 0 and "the account vision's limits: -" in cleared.stderr, cleared.stderr
    assert "gres/gpu" not in account_limits(team)["vision"]
    both = [job_id(team, run) for run in ("acct-a", "acct-b")]
    wait_for(lambda: _states(admin, both) == {"RUNNING"}, 120, "the held job to start once the limit went", 0.5)
    slurm_command(admin, "scancel", *both)
    wait_for(lambda: not _states(admin, both), 120, "alice's jobs to end", 0.5)


def account_limits(team: Team) -> dict[str, str]:
    """account -> the GrpTRES of its own association (sacctmgr's text)."""
    shown = slurm_command(load(team.admin), "sacctmgr", "--noheader", "--parsable2", "show", "association",
                          "format=user,account,grptres")  # fmt: skip
    return {account: tres for user, account, tres in (line.split("|") for line in shown.stdout.split()) if not user}


def test_the_budget_warning_and_the_reasons_read_slurms_figures():
    nearly = Standing("alice", "vision", budget=600, used=560)
    assert (
        budget_warning(nearly) == "warning: alice's GPU-hour budget is 93% spent (9.33 of 10.00 GPU-hours this month)"
    )
    assert budget_warning(Standing("alice", "vision", budget=600, used=500)) is None  # 83%
    assert budget_warning(Standing("alice", "vision", budget=600, used=600)) is None  # spent: the job says it is held
    assert budget_warning(Standing("alice", "vision")) is None  # no budget
    capped = Standing("bob", "nlp", max_jobs=2, max_nodes=1)
    assert held("(AssocMaxJobsLimit)", "bob", capped) == (
        "held (AssocMaxJobsLimit): bob runs 2 jobs at once already, their limit; it starts as one ends"
    )
    assert held("AssocMaxNodePerJobLimit", "bob", capped).startswith("held (AssocMaxNodePerJobLimit): bob may use 1 ")
    assert held("(Resources)", "bob", capped) is None and held("(Priority)", "bob", None) is None
    # the account's own cap and budget (all its members' jobs), which Slurm's reasons do not tell from a person's
    account = AccountStanding("vision", max_gpus=16, budget=6000, used=5700)
    assert budget_warning(Standing("alice", "vision", of_account=account)) == (
        "warning: the account vision's GPU-hour budget is 95% spent (95.00 of 100.00 GPU-hours this month)"
    )
    assert held("AssocGrpGRES", "alice", Standing("alice", "vision", max_gpus=4, of_account=account)) == (
        "held (AssocGrpGRES): alice's GPU limit (4 GPUs at once), or the account vision's GPU limit (16 GPUs at "
        "once, all its members), is in use by running jobs; it starts as they end"
    )
    spent = Standing("alice", "vision", budget=600, used=10, of_account=AccountStanding("vision", budget=60, used=60))
    assert held("AssocGrpGRESMinutes", "alice", spent).startswith(
        "held (AssocGrpGRESMinutes): the account vision's GPU-hour budget is spent (1.00 of 1.00 GPU-hours this month"
    )
    own = Standing("alice", "vision", budget=60, used=50, of_account=account)  # hers is the smaller remainder
    assert held("AssocGrpGRESMinutes", "alice", own).startswith("held (AssocGrpGRESMinutes): alice's GPU-hour budget")


def test_cost_by_user_adds_up_each_persons_node_and_gpu_hours_as_sacct_has_them(team: Team):
    admin = load(team.admin)
    recorded = slurm_command(admin, "sacct", "--allusers", "--allocations", "--noheader", "--parsable2",
                             "--starttime=now-1day", "--format=user,nnodes,elapsedraw,alloctres,start")  # fmt: skip
    expected: dict[str, list[float]] = {}
    for user, nodes, seconds, tres, started in (line.split("|") for line in recorded.stdout.splitlines()):
        if started not in ("Unknown", "None"):  # a job cancelled while pending never ran
            gpus = dict(item.split("=") for item in tres.split(",") if "=" in item).get("gres/gpu", "0")
            hours = expected.setdefault(user, [0.0, 0.0])
            hours[0] += int(nodes) * int(seconds) / 3600
            hours[1] += int(gpus) * int(seconds) / 3600
    assert expected["alice"][1] > 0  # her GPU jobs ran
    since = (datetime.now(UTC) - timedelta(days=1)).strftime("%Y-%m-%dT%H:%M")
    shown = cli("cost", "--by", "user", "--since", since, "--json", "--cluster", str(team.admin))
    assert shown.returncode == 0, shown.stderr
    document = UsageCostDocument.model_validate_json(shown.stdout, strict=True).model_dump()
    rows = {row["name"]: row for row in document["rows"]}
    assert rows.keys() == expected.keys()
    for user, (node_hours, gpu_hours) in expected.items():  # each row rounded once, to 4 places
        assert float(rows[user]["node_hours"]) == pytest.approx(node_hours, abs=1e-4), user
        assert float(rows[user]["gpu_hours"]) == pytest.approx(gpu_hours, abs=1e-4), user
        assert rows[user]["usd"] == "0.0000"  # the local cluster's price; the hours are real
    assert document["prices"] == "local cluster: no charge"
    by_account = json.loads(
        cli("cost", "--by", "account", "--since", since, "--json", "--cluster", str(team.admin)).stdout
    )
    assert {"vision", "nlp"} <= {row["name"] for row in by_account["rows"]}
    assert by_account["total"]["gpu_hours"] == document["total"]["gpu_hours"]
    table = cli("cost", "--by", "user", "--cluster", str(team.people["bob"]))
    assert table.returncode == 0 and "GPU-hours" in table.stdout and "alice" in table.stdout, table.stderr
    # each run says whose it is: its record and its MLflow run
    record = json.loads((team.state / "shared" / "runs" / "bob-run" / "run.json").read_text())
    assert (record["user"], record["account"]) == ("bob", "nlp")
    mlflow_run = (team.state / "shared" / "runs" / "gpu-a" / "mlflow_run_id").read_text().strip()
    assert admin.tracking_uri
    with urllib.request.urlopen(f"{admin.tracking_uri}/api/2.0/mlflow/runs/get?run_id={mlflow_run}") as answer:
        tags = {tag["key"]: tag["value"] for tag in json.load(answer)["run"]["data"]["tags"]}
    assert (tags["mlflow.user"], tags["slurm.account"]) == ("alice", "vision")  # the cluster's name, not root's


def test_a_limit_for_someone_not_in_the_list_is_refused(team: Team):
    refused = cli("users", "limit", "carol", "--gpu-hours", "5", "--cluster", str(team.admin))
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == ["error: carol is not in the list"]


def transactions(desc: ClusterDescription) -> list[str]:
    """Every change made to Slurm's accounting so far (sacctmgr's log of them)."""
    return slurm_command(desc, "sacctmgr", "--noheader", "--parsable2", "list", "transactions").stdout.splitlines()


def head_applies(team: Team, rounds: int) -> None:
    """Until the head's apply-users has applied the list `rounds` more times (its report's time moves on)."""
    report = team.state / "shared" / ".users" / "applied" / "head"

    def applied_at() -> float:
        return json.loads(report.read_text())["applied_at"]

    for _ in range(rounds):
        before = applied_at()
        wait_for(lambda b=before: applied_at() > b, APPLIED_S, "the head to apply the list again", interval=0.2)


def _states(desc: ClusterDescription, jobs: list[str]) -> set[str]:
    shown = slurm_command(desc, "squeue", "--noheader", "--format=%T", f"--jobs={','.join(jobs)}")
    return set(shown.stdout.split())


def test_removing_a_person_ends_their_logins_and_keeps_their_runs(team: Team):
    bob = load(team.people["bob"])
    with SSH(bob) as ssh:
        sessions = [ssh.popen(ssh.login, "sleep 600"), ssh.popen(ssh.node("node-0"), "sleep 600")]
        wait_for(lambda: _sessions_of(team, "bob") >= 2, 60, "bob's two sessions to start", interval=0.2)
        removed = cli("users", "remove", "bob", "--cluster", str(team.admin))
        assert removed.returncode == 0, removed.stderr
        for session in sessions:  # ended by the hosts' apply-users, which the CLI waited for
            session.wait(timeout=APPLIED_S)
        with pytest.raises(SSHFailure, match="authentication failed"):
            ssh.run(ssh.login, "true")
    assert all("bob" not in accounts(team, host) for host in HOSTS)
    assert not (local_accounts.etc_dir(_state(team), "head") / "ssh" / "dtrain-users" / "bob").exists()
    kept = team.state / "shared" / "runs" / "bob-run"
    assert (kept / "output.log").is_file() and (team.state / "shared" / "home" / "bob").is_dir()
    # the admin still sees bob's run; its owner is a uid no account has any more
    runs = json.loads(cli("jobs", "--json", "--all", "--cluster", str(team.admin)).stdout)["jobs"]
    assert [r["user"] for r in runs if r["run"] == "bob-run"] == [str(kept.stat().st_uid)]
    # no longer a Slurm user, and the record of his job kept
    assert "bob" not in {user for user, _ in associations(team)}
    assert ("bob", "nlp") in {(user, account) for _, user, account in recorded_jobs(team)}


def associations(team: Team) -> set[tuple[str, str]]:
    """(user, account) of Slurm's users, from slurmdbd."""
    shown = slurm_command(load(team.admin), "sacctmgr", "--noheader", "--parsable2", "show", "association",
                          "format=user,account")  # fmt: skip
    return {tuple(line.split("|")) for line in shown.stdout.split() if not line.startswith("|")}  # type: ignore[misc]


def recorded_jobs(team: Team) -> list[tuple[str, str, str]]:
    """(job id, user, account) of every job in the accounting database."""
    shown = slurm_command(load(team.admin), "sacct", "--allusers", "--noheader", "--parsable2", "--starttime=now-1day",
                          "--format=jobid,user,account", "--allocations")  # fmt: skip
    return [tuple(line.split("|")) for line in shown.stdout.split()]  # type: ignore[misc]


def _sessions_of(team: Team, person: str) -> int:
    """The sshd sessions serving person anywhere on this machine ("sshd: bob@notty")."""
    listing = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return sum(line.startswith(f"sshd: {person}@") for line in listing.splitlines())
