#!/usr/bin/env python3
"""spot-agent: on a Spot node, turn Azure's eviction notice into a checkpoint and a requeue.

Standard library only, Python 3.10+. It runs on every node as root (a systemd unit on Azure, started
by node setup; a daemon in each node of the local cluster) and polls the instance metadata service's
Scheduled Events, Azure's own signal of an eviction:

  GET http://169.254.169.254/metadata/scheduledevents?api-version=2020-07-01   (header Metadata: true)

A `Preempt` event that names this VM (IMDS's compute name) comes at least 30 s before the eviction
(NotBefore). For each one, once:
  1. drain the node in Slurm, so that no job starts on it (and a requeued job goes elsewhere);
  2. send SIGUSR1 to the training ranks of each job running on it: the processes of this node whose
     environment names the job (SLURM_JOB_ID, inherited by every process a job starts, in a container
     too) and that catch SIGUSR1. Signalling through Slurm (`scancel --signal=USR1 --full`) reaches
     only the batch script's own sessions, and horovodrun and torchrun start their ranks in new ones.
     The ranks save a checkpoint at the next step boundary they agree on (one signalled rank is
     enough: they vote at every boundary) and exit with status 75 (training/world/preemption.py);
  3. note the eviction in each job's run directory (evictions.json, which run.json carries);
  4. wait until each job has ended, at most until 15 s before NotBefore;
  5. requeue (`scontrol requeue`) each job that did not end with 0: it resumes from its newest
     checkpoint on whatever nodes come next. A job still running then (a rank frozen, the checkpoint
     cannot complete) is ended by the requeue, and resumes from the checkpoint before;
  6. with a shared file system to release (--release-program, sharedStorage lustre): once the jobs have
     left the node, run it (stop what still writes there, flush, unmount), within the notice, and say
     so in the node's Slurm comment (RELEASED), so that the power program does not ask again;
  7. once the jobs have left the node (their batch scripts record the attempt and upload the run),
     ask Slurm to power the node down (it comes back, through ResumeProgram, when a
     job needs it and Azure has Spot capacity again), and acknowledge the event (StartRequests), which
     lets Azure evict at once.

With --release-program it also answers the head node's power program, which asks before it deallocates
a node (dtrain/remote/slurm/slurm_power.py, release_shared): every --release-poll seconds it reads the
node's Slurm comment, and when that is RELEASE_REQUEST while Slurm powers the node down, it runs the
program and answers RELEASED, or RELEASE_FAILED (the reason in its log).

  python3 spot_agent.py --node node-0 [--endpoint http://169.254.169.254] [--interval 1]
        [--release-program shared-release --release-mount /shared [--release-poll 5]]

Exit status: 2 bad arguments; otherwise it runs until stopped (an unreachable endpoint is retried).
"""

import argparse
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime

ENDPOINT = "http://169.254.169.254"
EVENTS = "/metadata/scheduledevents?api-version=2020-07-01"
COMPUTE_NAME = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"
PREEMPTED_EXIT_CODE = 75  # training.exit_status.ExitCode.PREEMPTED (stands alone; tests/test_layout.py checks)
MARGIN_S = 5  # the acknowledgement happens this long before NotBefore at the latest
REQUEUE_S = 10  # and the requeue this long before that: a requeued job's batch script ends (its results upload)
# With a shared file system to release, the jobs' part of the notice ends this much earlier: the release
# (what still writes stopped, flushed, unmounted) fits in it. Of Azure's 30 s notice that leaves 10 s
# for the ranks to checkpoint: they stop within a step, at the next boundary they agree on.
RELEASE_S = 10
# What the release program gets when the head node asks: SIGTERM to SIGKILL, and everything.
RELEASE_GRACE_S = 10
RELEASE_TIMEOUT_S = 60
WAIT_STEP_S = 0.5
# The node's Slurm comment, between the head node's power program and this agent (its copies stand alone
# in dtrain/remote/slurm/slurm_power.py; tests/infra/test_release.py checks they match). One word each:
# scontrol's one-line listing, which the power program reads, ends a value at its first space; why a
# release failed is in this agent's log.
RELEASE_REQUEST = "release-shared"
RELEASED = "shared-released"
RELEASE_FAILED = "shared-release-failed"
# Slurm's flags of a node it powers down: a release request counts only then (a stale one never unmounts
# the file system of a node at work).
POWERING_DOWN = frozenset({"POWERING_DOWN", "POWER_DOWN", "POWERED_DOWN"})
EVICTIONS = "evictions.json"  # in the run directory
# They catch SIGUSR1 only to pass it on to what they started (srun to its step's tasks, docker's client
# to its container), which may not have its handler yet: a step still starting would die of it. The
# ranks below them carry the job's SLURM_JOB_ID too, and are signalled themselves once they catch it.
FORWARDERS = ("srun", "docker")
log = logging.getLogger("spot-agent")


def _utcnow():
    return datetime.now(timezone.utc)  # noqa: UP017 (Python 3.10 on the nodes)


def metadata(endpoint, path, body=None, timeout=5):
    request = urllib.request.Request(endpoint + path, data=body, headers={"Metadata": "true"})
    if body is not None:
        request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read()


def slurm(*argv, check=True):
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        log.warning("%s failed: %s", shlex.join(argv), (proc.stderr or proc.stdout).strip())
    return proc


def jobs_on(node, states="RUNNING"):
    out = slurm("squeue", "--noheader", f"--nodelist={node}", f"--states={states}", "--format=%A").stdout
    return out.split()


def job_fields(job_id):
    """`scontrol show job -o`'s Key=Value pairs (JobState, ExitCode, WorkDir...); {} once Slurm forgot it."""
    proc = slurm("scontrol", "show", "job", "-o", job_id, check=False)
    if proc.returncode != 0:
        return {}
    return dict(word.split("=", 1) for word in proc.stdout.split() if "=" in word)


def catches(status_text, signum):
    """Whether /proc/PID/status says the process has a handler for signum (SigCgt, a hex mask)."""
    for line in status_text.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def signal_ranks(job_id, skip=(), proc="/proc"):
    """SIGUSR1 to every process here that belongs to the job and catches it (but those in skip, and the
    FORWARDERS); returns their pids."""
    marker = f"SLURM_JOB_ID={job_id}".encode()
    signalled = []
    for entry in os.listdir(proc):
        if not entry.isdigit() or int(entry) in (os.getpid(), *skip):
            continue
        try:
            with open(os.path.join(proc, entry, "environ"), "rb") as handle:
                if marker not in handle.read().split(b"\0"):
                    continue
            with open(os.path.join(proc, entry, "comm")) as handle:
                if handle.read().strip() in FORWARDERS:
                    continue
            with open(os.path.join(proc, entry, "status")) as handle:
                if not catches(handle.read(), signal.SIGUSR1):
                    continue
            os.kill(int(entry), signal.SIGUSR1)
        except (OSError, ValueError):
            continue  # gone meanwhile, or not ours to read
        signalled.append(int(entry))
    return signalled


def signal_until_stopped(node, job_ids, deadline):
    """Signal each job's ranks here, and ranks that appear later (a job still starting), until every job
    has left RUNNING on the node or the deadline; returns the jobs still running."""
    signalled = {job: set() for job in job_ids}
    running = list(job_ids)
    while running:
        for job in running:
            new = signal_ranks(job, skip=signalled[job])
            if new:
                signalled[job].update(new)
                log.info("job %s: SIGUSR1 to rank(s) here, pids %s", job, ",".join(map(str, new)))
        if time.time() >= deadline:
            break
        time.sleep(WAIT_STEP_S)
        listed = set(jobs_on(node))
        running = [job for job in running if job in listed]
    return running


def record_eviction(job_id, entry):
    """Add the eviction to the job's run directory (its WorkDir), where run.json picks it up."""
    workdir = job_fields(job_id).get("WorkDir")
    if not workdir or not os.path.isfile(os.path.join(workdir, "job.json")):
        return  # not a run of `launch`
    path = os.path.join(workdir, EVICTIONS)
    try:
        with open(path) as handle:
            entries = json.load(handle)
    except (OSError, ValueError):
        entries = []
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as handle:
        json.dump([*entries, entry], handle, indent=2)
    os.replace(tmp, path)


def wait_for_jobs(node, job_ids, deadline, states="RUNNING"):
    """Until none of the jobs is on the node in one of states, or the deadline; returns those still there."""
    here = list(job_ids)
    while here and time.time() < deadline:
        listed = set(jobs_on(node, states))
        here = [job for job in here if job in listed]
        if here:
            time.sleep(WAIT_STEP_S)
    return here


def node_state(node):
    """(Slurm's state flags, its comment) of the node, or None when Slurm cannot be asked."""
    proc = slurm("scontrol", "--oneliner", "show", "node", node, check=False)
    if proc.returncode != 0:
        return None
    line, _, reason = proc.stdout.partition(" Reason=")  # free text, near the end of the line
    _, _, comment_after = reason.partition(" Comment=")  # where Slurm 22.05 lists it: after the reason
    fields = dict(word.split("=", 1) for word in line.split() if "=" in word)
    return set(fields.get("State", "").split("+")), fields.get("Comment", comment_after.split(" ", 1)[0].strip())


def run_release(release, timeout):
    """Run the release program (stop the writers on the mount, flush it, unmount it) within timeout seconds;
    returns (unmounted, what it said). Never raises."""
    program, mount = release
    argv = [program, "--mount", mount, "--grace", str(min(RELEASE_GRACE_S, timeout / 3)), "--timeout", str(timeout)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{program}: {exc}"
    lines = (proc.stdout or "").strip().splitlines()
    said = lines[-1] if lines else (proc.stderr or "").strip()[-200:]
    log.info("shared release of %s: exit %s, %s", mount, proc.returncode, said)
    try:
        error = json.loads(said).get("error", "")
    except ValueError:
        error = said
    return proc.returncode == 0, error


def answer(node, unmounted, why):
    """The node's comment: what the head node's power program waits for (why it failed: in this log)."""
    if not unmounted:
        log.warning("could not release the shared file system: %s", why)
    slurm("scontrol", "update", f"NodeName={node}", f"Comment={RELEASED if unmounted else RELEASE_FAILED}")


def answer_release_request(node, release):
    """The power program's request, if there is one while Slurm powers the node down: release, answer."""
    state = node_state(node)
    if state is None:
        return
    flags, comment = state
    if comment != RELEASE_REQUEST or not flags & POWERING_DOWN:
        return
    log.info("the head node asks for the shared file system before %s goes (%s)", node, "+".join(sorted(flags)))
    answer(node, *run_release(release, RELEASE_TIMEOUT_S))


def handle_preempt(event, node, endpoint, release=None):
    not_before = parsedate_to_datetime(event["NotBefore"]).timestamp() if event.get("NotBefore") else time.time()
    deadline = max(not_before - MARGIN_S, time.time() + 1)
    # the jobs' part of the notice: what is left once the release has its time
    jobs_deadline = deadline - RELEASE_S if release else deadline
    log.info("Preempt %s: %s is evicted at %s", event["EventId"], node, event.get("NotBefore"))
    slurm("scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason=spot eviction {event['EventId']}")
    jobs = jobs_on(node)
    for job in jobs:
        entry = {"event_id": event["EventId"], "node": node, "job_id": job, "not_before": event.get("NotBefore")}
        record_eviction(job, {**entry, "signalled_at": _utcnow().strftime("%Y-%m-%dT%H:%M:%SZ")})
    still_running = signal_until_stopped(node, jobs, jobs_deadline - REQUEUE_S)
    requeued = []
    for job in jobs:
        fields = job_fields(job)
        if fields.get("JobState") == "COMPLETED":
            log.info("job %s finished before the eviction", job)
            continue
        how = "did not stop in time" if job in still_running else f"ended {fields.get('ExitCode')}"
        log.info("job %s %s: requeueing it", job, how)
        slurm("scontrol", "requeue", job)
        requeued.append(job)
    # the requeued jobs' batch scripts record the attempt and upload the run: let them end before the node goes
    wait_for_jobs(node, jobs, jobs_deadline, states="RUNNING,COMPLETING")
    for job in requeued:
        # Slurm holds a requeued job back for two minutes, time for its epilog on the old nodes: that is done
        slurm("scontrol", "update", f"JobId={job}", "StartTime=now")
    if release:
        # what still writes there is stopped, then the mount flushed and unmounted: before the node goes
        answer(node, *run_release(release, max(1.0, deadline - time.time())))
    slurm("scontrol", "update", f"NodeName={node}", "State=POWER_DOWN_ASAP", "Reason=spot eviction")
    body = json.dumps({"StartRequests": [{"EventId": event["EventId"]}]}).encode()
    metadata(endpoint, EVENTS, body)
    log.info("acknowledged %s", event["EventId"])


def watch(node, endpoint, interval, release=None, release_poll=5.0):
    """release: (program, mount) of the shared file system to release before the node goes, or None."""
    handled = set()
    name = None
    next_release_check = 0.0
    while True:
        try:
            name = name or metadata(endpoint, COMPUTE_NAME).decode().strip()
            document = json.loads(metadata(endpoint, EVENTS))
            for event in document.get("Events", []):
                ours = event.get("EventType") == "Preempt" and name in event.get("Resources", [])
                if ours and event["EventId"] not in handled:
                    handled.add(event["EventId"])
                    handle_preempt(event, node, endpoint, release)
        except (OSError, ValueError, KeyError, subprocess.SubprocessError) as exc:
            log.warning("scheduled events: %s", exc)  # the endpoint or Slurm, briefly away: try again
        if release and time.monotonic() >= next_release_check:
            next_release_check = time.monotonic() + release_poll
            try:
                answer_release_request(node, release)
            except (OSError, ValueError, subprocess.SubprocessError) as exc:
                log.warning("release request: %s", exc)  # Slurm briefly away: the next poll asks again
        time.sleep(interval)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--node", required=True, help="this node's name in Slurm, in any case (its host name)")
    parser.add_argument("--endpoint", default=ENDPOINT, help="the instance metadata service (%(default)s)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between two polls (%(default)s)")
    parser.add_argument(
        "--release-program", help="what stops the writers on the shared file system and unmounts it (shared-release)"
    )
    parser.add_argument("--release-mount", help="the shared file system's mount point, which the program releases")
    parser.add_argument(
        "--release-poll",
        type=float,
        default=5.0,
        help="seconds between two reads of the node's Slurm comment (%(default)s)",
    )
    args = parser.parse_args(argv)
    if bool(args.release_program) != bool(args.release_mount) or args.release_poll <= 0:
        parser.error("--release-program and --release-mount go together; --release-poll must be more than 0")
    release = (args.release_program, args.release_mount) if args.release_program else None
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s", level=logging.INFO)
    # Slurm's node names are lower case, and it compares them case-sensitively; the unit passes the host
    # name (%H), in which Azure writes a scale set's base-36 instance digits in upper case (...00000A).
    node = args.node.lower()
    try:
        watch(node, args.endpoint, args.interval, release, args.release_poll)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
