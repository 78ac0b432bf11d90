#!/usr/bin/python3
"""Slurm power saving for Azure VM scale sets: deallocate idle nodes, start them for jobs.

Installed on the head node as /usr/local/sbin/slurm-power; slurmctld runs it, as SlurmUser, through
the wrappers slurm-suspend, slurm-resume and slurm-resume-fail, with the nodes as a hostlist:

    slurm-power suspend|resume|resume-fail hvd-gpu-[000000-000003]

and a systemd timer runs `slurm-power reap` every few minutes (slurm-power-reap.timer): a node that
Azure runs but Slurm holds as powered down (it never registered: a first boot that failed, an
instance started outside Slurm) is marked DOWN with the reason and deallocated once it has run
longer than a first boot may take to register (register_timeout_s). The same run reconciles the
other way: a node that Slurm holds as on but lost (DOWN after SlurmdTimeout: a Spot eviction that
the node's agent did not see in time) while Azure has deallocated it is powered down through Slurm
(POWER_DOWN_FORCE), so that Slurm starts it again (ResumeProgram) when a job needs it, instead of
leaving it DOWN for ever.
Slurm itself never suspends such a node: it believes it is off. With power_down_unused (autostop
on), a node that came up outside Slurm (the scale set's creation: Azure starts every instance) and
registered is powered down through Slurm at once, unless a job waits; a node that Slurm started for
a job (its resume leaves a comment on it) keeps the autostop time after its jobs.
When slurmctld does not answer the reaper at all (Slurm failed to install, the munge key never came,
slurm.conf is broken, slurmctld crash-loops), nothing can vouch for any instance: once it has been
silent for controller_grace_s, counted from the first round that found it so since the head node
booted (silence_file's time), every round deallocates every instance of the scale sets through
Azure alone. Slurm, once back, starts the nodes that its jobs need (ResumeProgram); one that it held
as on is lost (DOWN) and then powered down by the reconcile above.

With a shared file system that wants unmounting before its clients go (sharedStorage lustre: the config's
release_wait_s), suspend and the reaper first ask each node to release it (release_shared): through the
node's Slurm comment, which the node's Spot agent reads and answers once it has stopped what writes
there, flushed and unmounted it (dtrain/remote/boot/spot_agent.py, shared_release.py). They wait at
most release_wait_s, then deallocate whatever the nodes answered: a node that cannot answer (its agent
or slurmd gone) keeps its mount, and the file system's servers evict that client. With slurmctld silent
(reap_unvouched) there is no one to carry the request: the deallocation goes ahead at once.

It acts through the head node's user-assigned identity (an IMDS token for Azure Resource Manager),
whose only rights are a custom role on the scale set: start, deallocate, read an instance's view.
A scale set's node is named computerNamePrefix + its instance id in base 36 (six digits), so
the instance ids come from the names without asking Azure. The token never reaches argv or a log.

Python 3.10 standard library only (Ubuntu 22.04's python3); settings come from a JSON file written
by cloud-init (SLURM_POWER_CONFIG names another). Its optional "spot" entry names a second scale set
(the Spot nodes: scale_set_id, node_prefix, identity_client_id); each node goes to the set whose
prefix it carries.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

UTC = timezone.utc  # noqa: UP017 (datetime.UTC is Python 3.11; Ubuntu 22.04's python3 is 3.10)

CONFIG_PATH = os.environ.get("SLURM_POWER_CONFIG", "/etc/slurm/azure-power.json")
ARM_ENDPOINT = "https://management.azure.com"
IMDS_ENDPOINT = "http://169.254.169.254"
COMPUTE_API_VERSION = "2024-07-01"
IMDS_API_VERSION = "2018-02-01"
INSTANCE_SUFFIX_DIGITS = 6  # base-36 digits after computerNamePrefix
ATTEMPTS = 4
RETRY_SECONDS = 15
HTTP_TIMEOUT_SECONDS = 60
# How a node's reason begins once the reaper has deallocated it (dtrain/cluster/slurm.py reads it).
UNREGISTERED = "not registered"
# How the Spot agent's drain reason begins (dtrain/remote/boot/spot_agent.py), and the reconciler's.
SPOT_EVICTION = "spot eviction"
# The comment resume leaves on the nodes it starts; suspend clears it (the reaper reads it).
STARTED_BY_SLURM = "started-by-slurm"
# The node's comment, between release_shared and the node's Spot agent (its copies stand alone in
# dtrain/remote/boot/spot_agent.py; tests/infra/test_release.py checks they match): the request, and the answers.
RELEASE_REQUEST = "release-shared"
RELEASED = "shared-released"
RELEASE_FAILED = "shared-release-failed"
RELEASE_POLL_S = 2
RETRIED_STATUSES = frozenset({409, 429, 500, 502, 503, 504})  # conflicts (a deallocation still running) and throttling

log = logging.getLogger("slurm-power")


class PowerError(RuntimeError):
    """An Azure call that failed for good, in words for the Slurm node reason and the log."""


class SlurmSilent(RuntimeError):
    """slurmctld could not be asked (not running, not installed, or refusing us), in words for the log."""


class ScaleSet:
    def __init__(self, config: dict[str, Any]):
        self.scale_set_id = config["scale_set_id"]
        self.client_id = config["identity_client_id"]
        self.node_prefix = config["node_prefix"]
        # Other endpoints serve Azure's sovereign clouds (the token is asked for the one called).
        self.arm = config.get("arm_endpoint", ARM_ENDPOINT)
        self.imds = config.get("imds_endpoint", IMDS_ENDPOINT)
        self.retry_seconds: float = config.get("retry_seconds", RETRY_SECONDS)
        # How long to wait for the nodes to release the shared file system before they are deallocated;
        # None: nothing to release (NFS).
        self.release_wait_s: float | None = config.get("release_wait_s")
        self._token: str | None = None

    def instance_id(self, node: str) -> str:
        suffix = node[len(self.node_prefix) :]
        if not node.startswith(self.node_prefix) or len(suffix) != INSTANCE_SUFFIX_DIGITS or not suffix.isalnum():
            raise PowerError(f"{node} is not a node of this scale set (expected {self.node_prefix}<6 base-36 digits>)")
        return str(int(suffix, 36))

    def _access_token(self) -> str:
        if self._token is None:
            query = urllib.parse.urlencode(
                {"api-version": IMDS_API_VERSION, "resource": f"{self.arm}/", "client_id": self.client_id}
            )
            request = urllib.request.Request(
                f"{self.imds}/metadata/identity/oauth2/token?{query}", headers={"Metadata": "true"}
            )
            self._token = _send(request, self.retry_seconds)["access_token"]
        return self._token

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        url = f"{self.arm}{self.scale_set_id}{path}?api-version={COMPUTE_API_VERSION}"
        request = urllib.request.Request(
            url,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {self._access_token()}", "Content-Type": "application/json"},
        )
        return _send(request, self.retry_seconds)

    def start(self, instance_ids: list[str]) -> None:
        self.call("POST", "/start", {"instanceIds": instance_ids})

    def deallocate(self, instance_ids: list[str]) -> None:
        self.call("POST", "/deallocate", {"instanceIds": instance_ids})

    def deallocate_all(self) -> None:
        """Every instance of the scale set: Resource Manager's reading of a body without instanceIds."""
        self.call("POST", "/deallocate", {})

    @property
    def name(self) -> str:
        return self.scale_set_id.rsplit("/", 1)[-1]

    def instance_view(self, instance_id: str) -> dict[str, Any]:
        return self.call("GET", f"/virtualMachines/{instance_id}/instanceView")

    def states(self, instance_id: str) -> str:
        """Azure's view of one instance, e.g. 'ProvisioningState/failed/AllocationFailed, PowerState/stopped'."""
        return describe(self.instance_view(instance_id))


def describe(view: dict[str, Any]) -> str:
    return ", ".join(status.get("code", "?") for status in view.get("statuses", [])) or "no status"


# Power states of an instance that Azure has taken off its host (a Spot eviction with the Deallocate policy).
OFF_POWER_STATES = frozenset({"PowerState/deallocated", "PowerState/deallocating"})
# Power states in which Azure bills the VM: allocated to a host (a VM stopped from inside is, until deallocated).
BILLED_POWER_STATES = frozenset(
    {"PowerState/running", "PowerState/starting", "PowerState/stopping", "PowerState/stopped"}
)


def running_since(view: dict[str, Any]) -> datetime | None:
    """When an instance that Azure bills was started: the time of its last provisioning operation (a
    create or a start), as Azure records it; None for one that is deallocated (or being deallocated)."""
    codes = {status.get("code", ""): status for status in view.get("statuses", [])}
    if not BILLED_POWER_STATES & set(codes):
        return None
    stamps = [status.get("time") for code, status in codes.items() if code.startswith("ProvisioningState/")]
    if not stamps or not stamps[0]:
        return datetime.now(UTC)  # no record of the start: count from now rather than guess
    return datetime.fromisoformat(_six_digit_fraction(stamps[0]).replace("Z", "+00:00"))


def _six_digit_fraction(stamp: str) -> str:
    """Azure writes 100 ns fractions ('...:05.1234567+00:00'); Python 3.10 reads exactly three or six digits."""
    head, dot, rest = stamp.partition(".")
    if not dot:
        return stamp
    digits = len(rest) - len(rest.lstrip("0123456789"))
    return f"{head}.{rest[:digits][:6].ljust(6, '0')}{rest[digits:]}"


def _send(request: urllib.request.Request, retry_seconds: float) -> dict[str, Any]:
    """The JSON body of a 2xx answer; retries throttling, conflicts and server errors, then gives up."""
    where = f"{request.get_method()} {urllib.parse.urlsplit(request.full_url).path}"
    attempt = 1
    while True:
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_SECONDS) as response:
                text = response.read()
            return json.loads(text) if text.strip() else {}
        except urllib.error.HTTPError as error:
            problem = f"HTTP {error.code} {_azure_error(error.read())}"
            retry = error.code in RETRIED_STATUSES
        except (urllib.error.URLError, TimeoutError) as error:
            problem, retry = f"no answer ({error})", True
        if not retry or attempt == ATTEMPTS:
            raise PowerError(f"{where}: {problem}")
        log.warning("%s: %s; retrying in %ss (%d/%d)", where, problem, retry_seconds, attempt, ATTEMPTS)
        time.sleep(retry_seconds)
        attempt += 1


def _azure_error(body: bytes) -> str:
    try:
        error = json.loads(body)["error"]
        return f"{error['code']}: {error['message']}"
    except (ValueError, KeyError, TypeError):
        return body[:200].decode(errors="replace")


def expand(hostlist: str) -> list[str]:
    result = subprocess.run(["scontrol", "show", "hostnames", hostlist], capture_output=True, text=True, check=True)
    return result.stdout.split()


def mark_down(nodes: str, reason: str) -> None:
    """DOWN requeues the nodes' jobs at once; ReturnToService=2 lets a node back once it registers."""
    subprocess.run(["scontrol", "update", f"nodename={nodes}", "state=down", f"reason={reason}"], check=True)


def scale_sets(config: dict[str, Any]) -> list[ScaleSet]:
    """The on-demand scale set, and the Spot one where the config has it (its own id, prefix, identity)."""
    return [ScaleSet(config), *([ScaleSet({**config, **config["spot"]})] if config.get("spot") else [])]


def by_scale_set(sets: list[ScaleSet], hostlist: str) -> list[tuple[ScaleSet, list[str]]]:
    """The hostlist's nodes grouped by the scale set whose prefix they carry (Slurm mixes both kinds)."""
    return group_nodes(sets, expand(hostlist))


def group_nodes(sets: list[ScaleSet], nodes: list[str]) -> list[tuple[ScaleSet, list[str]]]:
    groups: dict[int, list[str]] = {}
    for node in nodes:
        # the longest prefix that fits; a node of neither is refused by the first set's instance_id
        index = max(
            range(len(sets)), key=lambda i: len(sets[i].node_prefix) if node.startswith(sets[i].node_prefix) else -1
        )
        groups.setdefault(index, []).append(node)
    return [(sets[index], nodes) for index, nodes in groups.items()]


def suspend(sets: list[ScaleSet], hostlist: str) -> None:
    for scale_set, nodes in by_scale_set(sets, hostlist):
        ids = [scale_set.instance_id(node) for node in nodes]  # a node of no scale set is refused first
        if scale_set.release_wait_s is not None:
            release_shared(nodes, scale_set.release_wait_s)
        scale_set.deallocate(ids)
        set_comment(nodes, "")
        log.info("deallocating %s", ",".join(nodes))


def release_shared(nodes: list[str], wait_s: float, poll_s: float = RELEASE_POLL_S) -> dict[str, str]:
    """Ask each node (its Slurm comment: RELEASE_REQUEST) to stop the writers on the shared file system,
    flush it and unmount it, and wait until each has answered or wait_s has passed; returns node ->
    outcome, each logged. A node whose agent already released it (a Spot eviction) is not asked again.
    Never raises for a node: its deallocation goes ahead whatever it answered."""
    current = slurm_nodes(nodes)
    outcomes = {node: "released before it was asked" for node in nodes if _comment(current, node) == RELEASED}
    pending = [node for node in nodes if node not in outcomes]
    if pending:
        set_comment(pending, RELEASE_REQUEST)
    deadline = time.monotonic() + wait_s
    while pending:
        shown = slurm_nodes(pending)
        for node in [node for node in pending if _comment(shown, node) in (RELEASED, RELEASE_FAILED)]:
            outcomes[node] = _comment(shown, node)
            pending.remove(node)
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    for node in pending:
        outcomes[node] = f"no answer within {wait_s:.0f} s: goes with the file system mounted"
    # why one failed is in its agent's log (journalctl -u spot-agent on the node)
    for node, outcome in outcomes.items():
        level = logging.WARNING if node in pending or outcome == RELEASE_FAILED else logging.INFO
        log.log(level, "%s: shared file system %s", node, outcome)
    return outcomes


def _comment(nodes: dict[str, tuple[set[str], str, str]], node: str) -> str:
    return nodes.get(node, (set(), "", ""))[1]


def resume(sets: list[ScaleSet], hostlist: str) -> None:
    for scale_set, nodes in by_scale_set(sets, hostlist):
        # Started for a job: once idle it gets the autostop time, not the reaper's at-once power down.
        set_comment(nodes, STARTED_BY_SLURM)
        try:
            scale_set.start([scale_set.instance_id(node) for node in nodes])
        except PowerError as error:
            # Fail the nodes now rather than let their jobs wait out ResumeTimeout (a Spot set refused
            # for want of capacity too: a job submitted with --spot-fallback then runs on demand).
            mark_down(",".join(nodes), f"resume failed: {error}"[:200])
            raise
        log.info("starting %s", ",".join(nodes))


def resume_failed(sets: list[ScaleSet], hostlist: str) -> None:
    for scale_set, nodes in by_scale_set(sets, hostlist):
        _give_up_on(scale_set, nodes)


def _give_up_on(scale_set: ScaleSet, nodes: list[str]) -> None:
    """Nodes that did not register within ResumeTimeout: say why in their reason, stop paying for them."""
    ids = {node: scale_set.instance_id(node) for node in nodes}
    for node, instance_id in ids.items():
        try:
            states = scale_set.states(instance_id)
        except PowerError as error:
            states = f"instance view unavailable: {error}"
        log.warning("%s did not join within ResumeTimeout: %s", node, states)
        mark_down(node, f"resume timed out: {states}"[:200])
    scale_set.deallocate(list(ids.values()))


def slurm_nodes(nodes: list[str] | None = None) -> dict[str, tuple[set[str], str, str]]:
    """node -> (its state flags, e.g. {'IDLE', 'CLOUD', 'POWERED_DOWN'}, its comment, its reason), for every
    node or those named."""
    which = [",".join(nodes)] if nodes else []
    shown = subprocess.run(
        ["scontrol", "--oneliner", "show", "node", *which], capture_output=True, text=True, check=True
    )
    found = {}
    for line in shown.stdout.splitlines():
        line, _, reason = line.partition(" Reason=")  # free text, near the end of the line: read apart
        # Slurm 22.05 lists a comment after the reason: its first word (ours are one word each)
        reason, _, comment_after = reason.partition(" Comment=")
        fields = dict(word.split("=", 1) for word in line.split() if "=" in word)
        if "NodeName" in fields:
            state = set(fields.get("State", "").split("+"))
            comment = fields.get("Comment", comment_after.split(" ", 1)[0])
            found[fields["NodeName"]] = (state, comment, reason)
    return found


def held_off(flags: set[str]) -> bool:
    """Slurm holds the node as powered down, and is not changing its power itself."""
    return "POWERED_DOWN" in flags and not flags & {"POWERING_UP", "POWERING_DOWN", "POWER_DOWN"}


def lost(flags: set[str], reason: str) -> bool:
    """Slurm holds the node as on but has given it up (DOWN: SlurmdTimeout passed, its jobs were requeued),
    and is not changing its power. A node drained by someone else than the Spot agent is theirs to return.
    A node only not responding yet is left to Slurm's own node-failure handling until then."""
    if flags & {"POWERED_DOWN", "POWERING_UP", "POWERING_DOWN", "POWER_DOWN"}:
        return False
    if "DRAIN" in flags and not reason.startswith(SPOT_EVICTION):
        return False
    return "DOWN" in flags


def powered_off(view: dict[str, Any]) -> bool:
    """Azure has deallocated the instance (or is deallocating it): a Spot eviction, or a stop outside Slurm."""
    return bool(OFF_POWER_STATES & {status.get("code", "") for status in view.get("statuses", [])})


def unused(flags: set[str], comment: str) -> bool:
    """Registered and idle with nothing planned on it, and not started by Slurm (resume marks those)."""
    return flags <= {"IDLE", "CLOUD"} and "IDLE" in flags and comment != STARTED_BY_SLURM


@dataclass(frozen=True)
class Silence:
    """Since when slurmctld has not answered the reaper: the modification time of since_file, made by
    the first round that finds it silent and removed by the first that it answers. The file lies in
    slurm-power-reap.service's runtime directory, so a reboot of the head node starts the count again."""

    since_file: str
    grace_s: int

    def seconds(self) -> float:
        """How long slurmctld has been silent: 0 at the first silent round, which starts the count."""
        try:
            return time.time() - os.stat(self.since_file).st_mtime
        except FileNotFoundError:
            with open(self.since_file, "x", encoding="utf-8") as file:
                file.write("slurm-power reap: slurmctld has not answered since this file's modification time\n")
            return 0.0

    def end(self) -> None:
        Path(self.since_file).unlink(missing_ok=True)


def reap(sets: list[ScaleSet], bound_s: int, power_down_unused: bool, silence: Silence) -> None:
    """Deallocate the instances that nothing vouches for: with slurmctld silent for silence.grace_s,
    every one (reap_unvouched); else those that Slurm holds as powered down (reap_unregistered)."""
    try:
        nodes = listed_nodes()
    except SlurmSilent as why:
        reap_unvouched(sets, silence, str(why))
        return
    silence.end()
    reap_unregistered(sets, nodes, bound_s, power_down_unused)


def listed_nodes() -> dict[str, tuple[set[str], str, str]]:
    """slurm_nodes(), or SlurmSilent where slurmctld cannot be asked."""
    try:
        return slurm_nodes()
    except subprocess.CalledProcessError as error:
        raise SlurmSilent(error.stderr.strip() or f"scontrol exited {error.returncode}") from error
    except OSError as error:  # no scontrol: the Slurm packages are not installed
        raise SlurmSilent(str(error)) from error


def reap_unvouched(sets: list[ScaleSet], silence: Silence, why: str) -> None:
    """With slurmctld silent, no instance can be told from a node at work: all are billed idle for all
    anyone can tell. Once the silence has lasted silence.grace_s, deallocate every instance of every
    scale set, at every round while it lasts (one that Azure or an operator started since too)."""
    silent_s = silence.seconds()
    silent_min = int(silent_s // 60)
    if silent_s < silence.grace_s:
        log.warning(
            "slurmctld does not answer (%s): silent for %d min; every instance is deallocated at %d min",
            why,
            silent_min,
            silence.grace_s // 60,
        )
        return
    failures = []
    for scale_set in sets:
        log.warning(
            "slurmctld has not answered for %d min (%s): no node is vouched for; deallocating every instance of %s",
            silent_min,
            why,
            scale_set.name,
        )
        try:
            scale_set.deallocate_all()
        except PowerError as error:  # one scale set that Azure refuses keeps the other one running
            failures.append(str(error))
    if failures:
        raise PowerError("; ".join(failures))


def reap_unregistered(
    sets: list[ScaleSet], nodes: dict[str, tuple[set[str], str, str]], bound_s: int, power_down_unused: bool
) -> None:
    """Deallocate the nodes that Azure has run for bound_s or longer while Slurm holds them as powered
    down: they never registered, and Slurm, which believes them off, would never suspend them. With
    power_down_unused (autostop on), also power down at once, through Slurm, the registered nodes that
    came up outside Slurm (a first boot) and sit idle while no job waits."""
    now = datetime.now(UTC)
    reconcile_lost(nodes, lambda node: _view_by_name(sets, node))
    for scale_set, names in group_nodes(sets, [node for node, (flags, _, _) in nodes.items() if held_off(flags)]):
        unregistered: dict[str, str] = {}
        for node in names:
            try:
                view = scale_set.instance_view(scale_set.instance_id(node))
            except PowerError as error:  # one node Azure cannot show keeps none of the others running
                log.warning("%s: no instance view: %s", node, error)
                continue
            since = running_since(view)
            if since is not None and (now - since).total_seconds() >= bound_s:
                minutes = int((now - since).total_seconds() // 60)
                unregistered[node] = f"{UNREGISTERED} {minutes} min after its start: deallocated ({describe(view)})"
        # Slurm may have begun to resume one since it was listed: that one is Slurm's again.
        now_held = slurm_nodes(list(unregistered)) if unregistered else {}
        still = [node for node in unregistered if node in now_held and held_off(now_held[node][0])]
        for node in still:
            log.warning("%s %s", node, unregistered[node])
            mark_down(node, unregistered[node][:200])
        if still and scale_set.release_wait_s is not None:
            release_shared(still, scale_set.release_wait_s)
        if still:
            scale_set.deallocate([scale_set.instance_id(node) for node in still])
        if still and scale_set.release_wait_s is not None:
            set_comment(still, "")  # the request answered: a start outside Slurm finds none
    idle = [node for node, (flags, comment, _) in nodes.items() if unused(flags, comment)]
    if power_down_unused and idle and not pending_jobs():
        log.info("%s came up outside Slurm and no job waits: powering down", ",".join(idle))
        subprocess.run(["scontrol", "update", f"nodename={','.join(idle)}", "state=power_down"], check=True)


def reconcile_lost(nodes: dict[str, tuple[set[str], str, str]], view_of: Callable[[str], dict[str, Any]]) -> list[str]:
    """Power down, through Slurm, the nodes that Slurm lost and Azure holds deallocated (view_of: a node's
    instance view); returns them. POWER_DOWN_FORCE clears DOWN and the agent's drain once the
    SuspendProgram has run (a deallocation of a deallocated instance changes nothing): the node is then
    powered down and free, and Slurm starts it again for the next job that needs it."""
    found = []
    for node, (flags, _, reason) in nodes.items():
        if not lost(flags, reason):
            continue
        try:
            view = view_of(node)
        except PowerError as error:
            log.warning("%s: lost by Slurm, and no instance view: %s", node, error)
            continue
        if not powered_off(view):
            continue  # Azure runs it: Slurm takes it back when its slurmd registers (ReturnToService=2)
        why = f"{SPOT_EVICTION} or stop outside Slurm: Azure deallocated it ({describe(view)})"
        log.warning("%s lost by Slurm (%s): %s; powering it down", node, "+".join(sorted(flags)), why)
        subprocess.run(
            ["scontrol", "update", f"nodename={node}", "state=power_down_force", f"reason={why}"[:200]], check=True
        )
        found.append(node)
    return found


def _view_by_name(sets: list[ScaleSet], node: str) -> dict[str, Any]:
    ((scale_set, _),) = group_nodes(sets, [node])
    return scale_set.instance_view(scale_set.instance_id(node))


def pending_jobs() -> bool:
    shown = subprocess.run(
        ["squeue", "--noheader", "--states=PENDING", "--format=%i"], capture_output=True, text=True, check=True
    )
    return bool(shown.stdout.strip())


def set_comment(nodes: list[str], comment: str) -> None:
    """Slurm's comment on the nodes (it survives their registration, unlike a reason); a failure is
    only logged, as it must never fail a resume or a suspend."""
    done = subprocess.run(
        ["scontrol", "update", f"nodename={','.join(nodes)}", f"comment={comment}"], capture_output=True, text=True
    )
    if done.returncode != 0:
        log.warning("could not set the comment of %s: %s", ",".join(nodes), done.stderr.strip())


ACTIONS = {"suspend": suspend, "resume": resume, "resume-fail": resume_failed}


def _reopen_standard_streams() -> None:
    # slurmctld closes every descriptor before it runs the program: without this, the first file
    # opened would become stdout or stderr.
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)


def main(argv: list[str]) -> int:
    _reopen_standard_streams()
    if argv[1:] != ["reap"] and (len(argv) != 3 or argv[1] not in ACTIONS):
        print(f"usage: {argv[0]} {{{'|'.join(ACTIONS)}}} HOSTLIST, or {argv[0]} reap", file=sys.stderr)
        return 2
    with open(CONFIG_PATH, encoding="utf-8") as file:
        config = json.load(file)
    # stdout and stderr lead nowhere under slurmctld: the log file is the record.
    logging.basicConfig(
        filename=config["log_file"], level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    action, hostlist = argv[1], " ".join(argv[2:])
    try:
        if action == "reap":
            silence = Silence(config["silence_file"], config["controller_grace_s"])
            reap(scale_sets(config), config["register_timeout_s"], config["power_down_unused"], silence)
        else:
            ACTIONS[action](scale_sets(config), hostlist)
    except (PowerError, subprocess.CalledProcessError) as error:
        log.error("%s %s failed: %s", action, hostlist, error)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
