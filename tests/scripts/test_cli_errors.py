"""Bad input to every operator command: a clear `error: ...`, the documented exit status, no traceback.

Each case runs the real command the way an operator would (`python -m dtrain <command> ...`, and
blob-pull as the NFS server runs it); none needs the local cluster. `{name}` in a case's arguments,
environment and message is a path (or URL) from the `paths` fixture. The statuses are the table in
docs/operator.md (dtrain/errors.py). The one entry point is checked too: every command listed, its
help teaching with examples, --cluster before or after the command.
"""

from __future__ import annotations

import http.server
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import pytest

from dtrain.cluster import description as cl
from dtrain.errors import ExitCode
from dtrain.local.cluster import Storage
from dtrain.local.cluster import _describe as local_describe
from dtrain.local.daemons import free_port
from dtrain.local.state import HostState, LocalState, NodeState
from dtrain.remote.boot import blob_pull
from tests.infra.ssh_keys import ED25519
from tests.local_http import serving

from .conftest import FIXTURES, REPO, private_key_file, run_module

OUTPUTS = json.loads((FIXTURES / "stack_outputs.json").read_text())
BAD, NOT_READY, FAILED = ExitCode.BAD_INPUT, ExitCode.NOT_READY, ExitCode.FAILED
# A private tmpfs mounted read-only over {ro} for the command alone (its own mount namespace).
READ_ONLY = (
    "unshare",
    "--mount",
    "--propagation",
    "private",
    "sh",
    "-c",
    'mount -t tmpfs -o ro none "$0" && exec "$@"',
)


@dataclass(frozen=True)
class Case:
    args: tuple[str, ...]
    code: int
    message: str
    env: dict[str, str] = field(default_factory=dict)
    read_only: bool = False  # run with {ro} mounted read-only

    def __str__(self) -> str:  # the test id
        return " ".join(self.args)[:80] or "(no arguments)"


def case(command: str, *, message: str, code: int = BAD, env: dict[str, str] | None = None, ro: bool = False) -> Case:
    """A bad command line, as shell words with `{name}` placeholders for paths."""
    return Case(tuple(shlex.split(command)), code, message, env or {}, ro)


# --- the inputs on disk ------------------------------------------------------------------------
class BlobService(http.server.BaseHTTPRequestHandler):
    """Answers like a URL that is not a blob container, a refusing service, a missing container, and
    a listing with a malformed blob."""

    ANSWERS: ClassVar[dict[str, tuple[int, str, str]]] = {
        "/html": (200, "text/html", "<html><body>a web page</body></html>"),
        "/denied": (403, "application/xml", "<Error><Code>AuthenticationFailed</Code><Message>no</Message></Error>"),
        "/gone": (404, "application/xml", "<Error><Code>ContainerNotFound</Code><Message>no</Message></Error>"),
        "/odd": (
            200,
            "application/xml",
            "<EnumerationResults><Blobs><Blob><Name>a</Name><Properties><Content-Length>many</Content-Length>"
            "</Properties></Blob></Blobs><NextMarker/></EnumerationResults>",
        ),
    }

    def do_GET(self) -> None:
        status, kind, body = self.ANSWERS[self.path.split("?")[0]]
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def blob_service() -> Iterator[str]:
    with serving(BlobService) as base:
        yield base


def _write(path: Path, data: str | bytes, mode: int = 0o644) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data)
    path.chmod(mode)
    return str(path)


def _descriptions(tmp: Path, key: Path) -> dict[str, str]:
    """Valid descriptions (Azure, docker and host runtime), one whose SSH key is gone, one of an old schema."""

    def saved(name: str, **kwargs: object) -> str:
        return str(cl.from_stack_outputs(OUTPUTS, "dev", known_hosts=tmp / "kh", **kwargs).save(tmp / name))  # type: ignore[arg-type]

    old = json.loads(Path(saved("cluster-old.json", ssh_key=key)).read_text())
    old |= {"schema_version": 1, "node_registry_path": "/shared/nodes"}  # as written before Slurm
    return {
        "desc": saved("cluster.json", ssh_key=key),
        "desc_host": saved("cluster-host.json", ssh_key=key, runtime="host"),
        "desc_no_key": saved("cluster-nokey.json", ssh_key=tmp / "gone" / "id_ed25519"),
        "old_schema": _write(tmp / "cluster-old.json", json.dumps(old), 0o600),
        "desc_local": _local_description(tmp, key),
    }


def _local_description(tmp: Path, key: Path) -> str:
    """The description a local cluster of 2 CPU nodes writes (`local up`), made without starting one."""
    state = LocalState(
        name="t",
        mode="localhost",
        state_dir=str(tmp / "state-local"),
        ports={"jumpbox": 1, "nfs": 2},
        head=HostState(hostname="head", address="127.0.0.1"),
        slurm_conf=str(tmp / "state-local" / "slurm.conf"),
        nodes=[NodeState(hostname=f"node-{i}", address="127.0.0.1", ssh_port=3 + i) for i in range(2)],
    )
    storage = Storage("http://127.0.0.1:1/devstoreaccount1", "UseDevelopmentStorage=true", "sv=1&sig=d", "sv=1&sig=r")
    desc = local_describe(state, Path(sys.executable), key, tmp / "kh-local", storage)
    return str(desc.save(tmp / "cluster-local.json"))


def _state_dirs(tmp: Path) -> dict[str, str]:
    recorded = tmp / "state-recorded"
    recorded.mkdir()
    LocalState(name="t", mode="localhost", state_dir=str(recorded)).save()  # nothing runs
    return {
        "state_recorded": str(recorded),
        "state_not_utf8": str(Path(_write(tmp / "state-not-utf8" / "state.json", b"\xff\xfe")).parent),
        "state_wrong": str(Path(_write(tmp / "state-wrong" / "state.json", '{"name": 1}')).parent),
        "not_empty": str(Path(_write(tmp / "not-empty" / "notes.txt", "mine")).parent),
    }


@pytest.fixture
def paths(tmp_path: Path, blob_service: str) -> dict[str, str]:
    key = private_key_file(tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "ro").mkdir()
    (tmp_path / "runs" / "r1").mkdir(parents=True)
    context = tmp_path / "context"
    for fw in ("pytorch", "tensorflow"):
        _write(context / "training" / "docker" / f"Dockerfile.{fw}", "FROM scratch\n")
    return {
        "tmp": str(tmp_path),
        "key": str(key),
        "open_key": _write(tmp_path / "open_key", "key\n", 0o644),
        "pub": _write(tmp_path / "id_ed25519.pub", ED25519 + "\n"),
        "private": _write(tmp_path / "id_other", "-----BEGIN OPENSSH PRIVATE KEY-----\nb3Blbg==\n", 0o600),
        "file": _write(tmp_path / "file.txt", "a file\n"),
        "empty": str(tmp_path / "empty"),
        "missing": str(tmp_path / "missing"),
        "ro": str(tmp_path / "ro"),
        "runs": str(tmp_path / "runs"),
        "dataset": str(Path(_write(tmp_path / "dataset" / "train" / "a.txt", "x")).parents[1]),
        "unreadable": str(Path(_write(tmp_path / "unreadable" / "train" / "c" / "a.JPEG", "not a JPEG")).parents[2]),
        "context": str(context),
        "not_utf8": _write(tmp_path / "not-utf8.json", b'{"name": "\xff"}'),
        "not_json": _write(tmp_path / "not-json.json", "{name: dev}"),
        "wrong_schema": _write(tmp_path / "wrong.json", json.dumps({"name": "dev", "node_count": "two"})),
        "bad_outputs": _write(tmp_path / "outputs-two.json", json.dumps({**OUTPUTS, "node_count": "two"})),
        "list_outputs": _write(tmp_path / "outputs-list.json", json.dumps({**OUTPUTS, "nccl_env": ["A=1"]})),
        "bad_time_outputs": _write(tmp_path / "outputs-time.json", json.dumps({**OUTPUTS, "max_job_time": "forever"})),
        "fake_pulumi": str(FIXTURES / "bin"),
        "failing_az": str(Path(_write(tmp_path / "azbin" / "az", "#!/bin/sh\necho no >&2\nexit 1\n", 0o755)).parent),
        "server": blob_service,
        "closed": f"http://127.0.0.1:{free_port()}",
        **_descriptions(tmp_path, key),
        **_state_dirs(tmp_path),
    }


def check(command: str, bad: Case, paths: dict[str, str]) -> subprocess.CompletedProcess:
    """Run `python -m <command> <case's arguments>` (command: e.g. `dtrain stage`) and check its error."""
    module, *words = command.split()
    args = [arg.format(**paths) for arg in bad.args]
    env = {name: value.format(**paths) for name, value in bad.env.items()}
    prefix = [*READ_ONLY, paths["ro"]] if bad.read_only else []
    proc = run_module(module, *words, *args, env=env, timeout=60, prefix=prefix, stdin=subprocess.DEVNULL)
    assert proc.returncode == bad.code, proc.stderr
    assert bad.message.format(**paths) in proc.stderr
    assert "error: " in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    return proc


# --- per CLI: the command line (shell words, `{name}` from paths), then what must come back ---
UPLOAD = "upload --cluster {desc} --dataset ds --no-progress"
STAGE = [
    case(f"{UPLOAD} {{dataset}} --workers 0", message="argument --workers: must be a whole number"),
    case(f"{UPLOAD} {{dataset}} --shard-size-mb -5", message="must be a number > 0, got '-5'"),
    case(f"{UPLOAD} {{dataset}} --shard-size-mb 0", message="must be a number > 0, got '0'"),
    # a prefix of a flag is not taken for the flag (argparse's default would read --work as --workers)
    case(f"{UPLOAD} {{dataset}} --work 4", message="unrecognized arguments: --work 4"),
    case(f"{UPLOAD} {{dataset}} --short-side 32", message="--short-side: must be a whole number between 64 and 1024"),
    case(f"{UPLOAD} {{dataset}} --short-side 160 --quality 101", message="--quality: must be a whole number between"),
    case(f"{UPLOAD} {{dataset}} --quality 80", message="--quality applies to the transcoded copy: give --short-side"),
    case(f"{UPLOAD} {{unreadable}} --short-side 160", message="transcode: none of the 1 images under {unreadable}"),
    case(
        "generate {ro}/tiny",
        ro=True,
        message="cannot write to the output directory {ro}/tiny ({ro}): read-only file system (choose a writable",
    ),
    case("generate {file}", message="the output directory {file} is a file, not a directory"),
    case("generate ''", message="argument DIR: must not be empty"),
    case("generate", message="the following arguments are required: DIR"),
    case("generate {tmp}/g --classes 0", message="argument --classes: must be a whole number >= 1"),
    case("generate {tmp}/g --image-size 4", message="--image-size: must be a whole number between 8"),
    case(f"{UPLOAD} {{missing}}", message="dataset path {missing} does not exist"),
    case(f"{UPLOAD} {{file}}", message="dataset path {file} is not a directory"),
    case(f"{UPLOAD} {{empty}}", message="dataset path {empty} has no files"),
    case("upload {dataset} --dataset ../x", message="invalid dataset name '../x'"),
    # `-x` would reach blob-pull as a flag of its own, `.x` is hidden
    case("pull --cluster {desc} --dataset=-x", message="invalid dataset name '-x'"),
    case("upload {dataset} --dataset imagenet/.cache", message="invalid dataset name 'imagenet/.cache'"),
    case("upload {dataset}", message="the following arguments are required: --dataset"),
    case("all --dataset ds", message="the following arguments are required: SOURCE"),
    case(
        f"{UPLOAD} {{dataset}} --sas-env HVD_TEST_UNSET_SAS",
        message="environment variable HVD_TEST_UNSET_SAS is empty or unset",
    ),
    case(
        f"{UPLOAD} {{dataset}} --shard-size-mb 1 --shard-dir {{file}}",
        message="the shard directory {file} is a file, not a directory",
    ),
    case("pull --cluster {not_json} --dataset ds", message="cluster description {not_json} is not JSON"),
    case("pull --cluster {missing} --dataset ds", message="no cluster description at {missing}"),
    case(
        "pull --dataset ds",
        env={"CLUSTER_DESCRIPTION": "{missing}"},
        message="no cluster description at {missing}: run `dtrain local up`",
    ),
    case("pull --dataset ds --pull-workers 0", message="argument --pull-workers: must be a whole number"),
    case("pull --dataset ds --source {dataset}", message="unrecognized arguments: --source"),
    case("", message="the following arguments are required: {{generate,upload,pull,all}}"),
]

FROM_STACK = "from-stack --stack dev -o {tmp}/out.json --ssh-key"
PULUMI = {"PATH": "{fake_pulumi}:/usr/bin:/bin"}
CLUSTER = [
    case("", message="the following arguments are required: {{from-stack,show,for-user}}"),
    case(f"{FROM_STACK} {{key}} --user root", message="argument --user: 'root' is an account the hosts keep"),
    case("for-user Alice --ssh-key {key} --cluster {desc}", message="argument NAME: 'Alice' is not a user name"),
    case("for-user alice --ssh-key {open_key} --cluster {desc}", message="is readable by other users (mode 0644)"),
    case("show --cluster {not_utf8}", message="cluster description {not_utf8} is not UTF-8 text (byte 10)"),
    case("show --cluster {not_json}", message="cluster description {not_json} is not JSON (Expecting"),
    case("show --cluster {wrong_schema}", message="node_count: Input should be a valid integer"),
    case("show --cluster {empty}", message="cannot read the cluster description {empty}: it is a directory"),
    case("show --cluster {missing}", message="no cluster description at {missing}: run"),
    case("show --cluster {old_schema}", message="has schema version 1, this version reads 2: write it again"),
    case(f"{FROM_STACK} {{missing}}", message="cannot use the SSH key {missing}: it does not exist"),
    case(f"{FROM_STACK} {{open_key}}", message="is readable by other users (mode 0644)"),
    case(f"{FROM_STACK} {{empty}}", message="SSH key {empty} is not a file"),
    case(
        f"{FROM_STACK} {{key}} --cwd {{missing}}",
        env=PULUMI,
        message="the Pulumi project directory {missing} does not exist (--cwd)",
    ),
    *[
        case(
            f"{FROM_STACK} {{key}}",
            env={**PULUMI, "FAKE_PULUMI_OUTPUTS": outputs},
            message=f"stack 'dev' has invalid outputs: {problem}",
        )
        for outputs, problem in (
            ("{bad_outputs}", "node_count: Input should be a valid integer"),
            ("{list_outputs}", "nccl_env: Input should be a valid dictionary"),
            ("{bad_time_outputs}", "max_job_time: use Slurm's --time syntax"),
        )
    ],
    case(
        f"{FROM_STACK} {{key}}",
        env={**PULUMI, "FAKE_PULUMI_OUTPUTS": "{not_json}"},
        code=FAILED,
        message="pulumi returned no JSON for stack 'dev'",
    ),
    case(f"{FROM_STACK} {{key}} --image-tag 'bad tag'", message="argument --image-tag: invalid image tag 'bad tag'"),
    case(
        f"{FROM_STACK} {{key}} --default-time 8-00:00:00",
        env=PULUMI,
        message="--default-time 8-00:00:00 is longer than the maxJobTime of stack 'dev', 7-00:00:00",
    ),
    case("from-stack --stack dev --ssh-key {key} -o {empty}", message="--output {empty} is a directory"),
    case(
        f"{FROM_STACK} {{key}}",
        env={"PATH": "{empty}"},
        code=NOT_READY,
        message="pulumi is not installed or not on PATH",
    ),
    case("from-stack --stack ''", message="argument --stack: must not be empty"),
    case(
        "from-stack --stack nope -o {tmp}/out.json --ssh-key {key}",
        env=PULUMI,
        message="cannot read outputs of stack 'nope': error: no stack named 'nope' found",
    ),
]

ACR = "--registry acr --dry-run"
BUILD_IMAGES = [
    case(f"{ACR} --context {{missing}}", message="build context {missing} does not exist"),
    case(f"{ACR} --context {{file}}", message="build context {file} is not a directory"),
    case(f"{ACR} --tag t --context {{empty}}", message="no Dockerfile for pytorch: expected training/docker/"),
    case(f"{ACR} --tag 'bad tag:with/colon'", message="argument --tag: invalid image tag 'bad tag:with/colon'"),
    case(f"{ACR} --tag ''", message="argument --tag: invalid image tag ''"),
    case(f"{ACR} --tag .hidden", message="invalid image tag '.hidden'"),
    case(f"{ACR} --tag {'x' * 129}", message="invalid image tag 'xxx"),
    case("--registry 'not a registry'", message="argument --registry: invalid registry 'not a registry'"),
    case("--registry ''", message="argument --registry: invalid registry ''"),
    case(f"{ACR} --framework mxnet", message="argument --framework: invalid choice: 'mxnet'"),
    case(
        "--tag t",
        env={"CLUSTER_DESCRIPTION": "{missing}"},
        message="no cluster description at {missing}: run",
    ),
    case(
        "--tag t --cluster {missing}",
        message="(or name the registry: --registry NAME or --stack NAME)",
    ),
    case("--registry acr --stack dev", message="argument --stack: not allowed with argument --registry"),
    case("--registry acr --cluster {desc} --tag t", message="pass one of --registry, --stack or --cluster"),
    case("--cluster {not_utf8} --tag t", message="cluster description {not_utf8} is not UTF-8"),
    case("--cluster {desc_host} --tag t", message="has no images (host runtime?)"),
    case(
        "--registry acr --tag t --context {context}",
        env={"PATH": "{empty}"},
        code=NOT_READY,
        message="az is not installed or not on PATH: install the Azure CLI",
    ),
    case(
        "--registry acr --tag t --context {context}",
        env={"PATH": "{failing_az}"},
        code=FAILED,
        message="az acr build failed for acr.azurecr.io/hvd-pytorch:t",
    ),
    case(f"{ACR} --context {{context}}", message="cannot read the git revision of"),
    case("--stack dev", env={"PATH": "{empty}"}, code=NOT_READY, message="pulumi is not installed or not on PATH"),
]

RUN = "--cluster {desc} --framework pytorch"
LAUNCH = [
    case(f"{RUN} --run-id ../../x", message="argument --run-id: invalid run id '../../x'"),
    case(f"{RUN} --run-id ..", message="invalid run id '..'"),
    case(f"{RUN} --run-id 'a b'", message="invalid run id 'a b'"),
    # `-x` would reach the job's upload as a flag of its own; `.x` could name the share's `.workdirs`
    case(f"{RUN} --run-id=-x --dry-run", message="argument --run-id: invalid run id '-x'"),
    case(f"{RUN} --run-id .workdirs --dry-run", message="argument --run-id: invalid run id '.workdirs'"),
    case(f"{RUN} --resume-from=-x --dry-run", message="argument --resume-from: invalid run id '-x'"),
    case(f"{RUN} --nodes 0", message="argument --nodes: must be a whole number >= 1, got '0'"),
    case(f"{RUN} --nodes 3", message="--nodes 3: the cluster has 2 nodes"),
    case(f"{RUN} --gpus-per-node 16", message="--gpus-per-node 16 asks for 16 GPUs on a node, and a node of cluster"),
    case(f"{RUN} --gpus 9", message="a node of cluster dev has 8: ask for --nodes 2 --gpus-per-node 8"),
    # never advice to use more nodes than the cluster has (2 here)
    case(f"{RUN} --gpus 17", message="a node of cluster dev has 8: it has 2 nodes, 16 GPUs in all"),
    case(f"{RUN} --time 99999999999", message="argument --time/--time-limit: invalid time limit '99999999999': more"),
    case(f"{RUN} --gpus 3 --nodes 2", message="--gpus 3 does not divide evenly over --nodes 2"),
    case(f"{RUN} --gpus 1 --gpus-per-node 1", message="argument --gpus-per-node: not allowed with argument --gpus"),
    # CPU nodes of 2 CPUs (the local cluster's): refused under --dry-run as at submission (sinfo's CPUs)
    case(
        "--cluster {desc_local} --framework pytorch --gpus-per-node 3 --dry-run",
        message="error: --gpus-per-node 3 runs 3 processes on each node, and the nodes of cluster local-t have 2 CPUs",
    ),
    case(f"{RUN} --time-limit 0", message="argument --time/--time-limit: invalid time limit '0'"),
    case(f"{RUN} --time 1:2:3:4", message="argument --time/--time-limit: invalid time limit '1:2:3:4'"),
    # the recorded stack caps jobs at 7 days (maxJobTime): Slurm would leave a longer one pending for ever
    case(
        f"{RUN} --time 7-00:00:01 --dry-run",
        message="error: --time 7-00:00:01 is longer than cluster dev allows, 7-00:00:00 (maxJobTime in its stack's",
    ),
    case(f"{RUN} --warn-before soon --dry-run", message="argument --warn-before: invalid --warn-before 'soon'"),
    case(
        f"{RUN} --time 5 --warn-before 10m --dry-run",
        message="error: --warn-before 600s is not shorter than the time limit (5): pass a shorter one, or 0 for none",
    ),
    case(f"{RUN} --env MLFLOW_RUN_ID=1 --dry-run", message="MLFLOW_RUN_ID: the job sets MLflow's variables itself"),
    case(f"{RUN} --env PYTHONHOME=/opt --dry-run", message="PYTHONHOME: an env reaches the job's own tools too"),
    case(
        f"{RUN} --env A={'x' * 40 * 1024} --env B={'x' * 40 * 1024} --dry-run",
        message="envs and secrets: 80.0 KiB together; a job's envs and secrets hold at most 64 KiB in all",
    ),
    # a port out of range was accepted, and the job ran untracked
    case(f"{RUN} --tracking-uri http://mlflow:99999 --dry-run", message="(a port, if any, from 1 to 65535), or 'none'"),
    case(f"{RUN} --tracking-uri http://mlflow:0/x --dry-run", message="server (a port, if any, from 1 to 65535)"),
    case("--cluster {desc}", message="launch needs --framework (our training jobs) or --workdir (your own code)"),
    case("--cluster {desc} --workdir {tmp}", message="--workdir runs the command after `--`: add it"),
    case("--cluster {desc} --workdir {tmp}/nope -- python x.py", message="--workdir {tmp}/nope: no such directory"),
    case("--cluster {desc} --workdir {tmp} --model-parallel -- python x.py", message="leave out --model-parallel"),
    case("--cluster {desc} --workdir {tmp} --workdir-max-mb 0.001 -- python x.py", message="MiB to send, more than"),
    case("--cluster {desc} --workdir {tmp} --local-copy -- python x.py", message="--local-copy rewrites our jobs'"),
    # with own code, --framework picks the image and the default launcher: where neither, it did nothing
    case(
        "--cluster {desc_host} --workdir {tmp} --framework tensorflow --launcher horovodrun -- python x.py",
        message="--framework tensorflow does nothing with --workdir here: cluster dev runs jobs on its hosts, and "
        "--launcher horovodrun starts it",
    ),
    case(
        "--cluster {desc} --workdir {tmp} --framework keras --image img:1 --mode per-node -- python x.py",
        message="the command runs in --image img:1, and it is its own launcher (--mode per-node)",
    ),
    case(f"{RUN} --follow --detach", message="argument --detach: not allowed with argument --follow"),
    case("--cluster {desc} --framework keras --launcher torchrun", message="torchrun runs PyTorch jobs only"),
    # own code in TensorFlow's image: the flags the user gave are the ones named
    case(
        "--cluster {desc} --workdir {tmp} --framework tensorflow --launcher torchrun -- python x.py",
        message="--launcher torchrun runs PyTorch jobs only, --framework tensorflow's image has no torch",
    ),
    case("--cluster {desc} --framework mxnet", message="argument --framework: invalid choice: 'mxnet'"),
    case("--cluster {not_utf8} --framework pytorch", message="cluster description {not_utf8} is not UTF-8"),
    case("--cluster {wrong_schema} --framework keras", message="invalid cluster description {wrong_schema}"),
    case("--cluster {missing} --framework pytorch", message="no cluster description at {missing}"),
    case(
        "--cluster {desc_no_key} --framework pytorch",
        message="the cluster description's ssh_key: cannot use the SSH key {tmp}/gone/id_ed25519: it does not exist",
    ),
]

# a JOB that is not a job id is a run id: checked before any connection (the description's hosts are not there)
JOBS = [
    case("logs --cluster {desc} -- -x", message="argument JOB: invalid run id '-x'"),
    case("cancel --cluster {desc} 42 -- -x", message="argument JOB: invalid run id '-x'"),
    case("exec --cluster {desc} .x -- true", message="argument JOB: invalid run id '.x'"),
    case("results --cluster {desc} -- -x", message="argument RUN: invalid run id '-x'"),
]

# a NODE that is not a host name, and flags that contradict each other: refused before any connection (an
# unknown node needs the cluster: tests/scripts/test_slow_ranks.py)
DRAIN = [
    case("drain --cluster {desc} 'node 1'", message="argument NODE: 'node 1' is not a node name (`dtrain status`"),
    case("drain --cluster {desc} -- -node-1", message="argument NODE: '-node-1' is not a node name"),
    case(
        "drain --cluster {desc} node-1 --requeue --undo", message="argument --undo: not allowed with argument --requeue"
    ),
    case(
        "drain --cluster {desc} node-1 --undo --reason x", message="--reason is for draining: --undo resumes the node"
    ),
    case("drain --cluster {desc} node-1 --reason ''", message="argument --reason"),
    case("drain --cluster {missing} node-1", message="no cluster description at {missing}"),
]

ADD = "add alice --cluster {desc} --account vision --ssh-key"
USERS = [
    case("add Alice --ssh-key {pub} --account vision", message="argument name: 'Alice' is not a user name"),
    case(f"{ADD} {{missing}}", message="cannot read the --ssh-key {missing}: it does not exist"),
    case(f"{ADD} {{file}}", message="--ssh-key {file}: must be an OpenSSH public key"),
    case(f"{ADD} {{private}}", message="--ssh-key {private} is a private key: pass the public one (the .pub file)"),
    case(f"{ADD} {{pub}} --max-gpus 0", message="argument --max-gpus: must be a whole number"),
    case("add alice --ssh-key {pub} --account Vision", message="--account: 'Vision' is not a Slurm account name"),
    case("remove root --cluster {desc}", message="argument name: 'root' is an account the hosts keep"),
    case(f"{ADD} {{pub}} --gpu-hours lots", message="argument --gpu-hours: must be a number >= 0, got 'lots'"),
    case(
        "limit alice --cluster {desc} --gpu-hours -1", message="argument --gpu-hours: must be a number >= 0, got '-1'"
    ),
    case("limit alice --cluster {desc} --gpu-hours 0.001", message="--gpu-hours: 0.001 GPU-hours is less than a GPU-"),
    case("limit alice --cluster {desc} --max-jobs 0", message="argument --max-jobs: must be a whole number >= 1"),
    case("limit alice --cluster {desc}", message="users limit: give a limit to set (--max-jobs, --max-nodes, --max-"),
    case("limit Alice --cluster {desc} --clear", message="argument name: 'Alice' is not a user name"),
]

STATE = "--state-dir {tmp}/state"
LOCAL_CLUSTER = [
    case(f"up {STATE} --nodes 0", message="argument --nodes: must be a whole number between 1 and 32, got '0'"),
    case(f"up {STATE} --nodes 33", message="argument --nodes: must be a whole number between 1 and 32"),
    case(f"up {STATE} --name ''", message="argument --name: invalid cluster name ''"),
    case(f"up {STATE} --name 9lives", message="invalid cluster name '9lives'"),
    case(f"up {STATE} --name toolongname", message="invalid cluster name 'toolongname'"),
    case(f"up {STATE} --name a-b", message="invalid cluster name 'a-b'"),
    case(f"up {STATE} --subnet nonsense", message="argument --subnet: invalid subnet 'nonsense'"),
    case(f"up {STATE} --subnet 10.213.0.0/30", message="subnet 10.213.0.0/30 is too small: use a /28 or larger"),
    case(f"up {STATE} --subnet fd00::/64", message="subnet fd00::/64 is not a private IPv4 range"),
    case(f"up {STATE} --subnet 10.213.0.5/24", message="invalid subnet '10.213.0.5/24': 10.213.0.5/24 has host"),
    case(f"up {STATE} --subnet 8.8.8.0/24", message="subnet 8.8.8.0/24 is not a private IPv4 range"),
    case(f"up {STATE} --train-python {{missing}}", message="--train-python {missing} is not an executable file"),
    case(f"up {STATE} --mode bogus", message="argument --mode: invalid choice: 'bogus'"),
    case(f"up {STATE} --link-rate fast", message="argument --link-rate: invalid link rate 'fast': expected a rate"),
    case(f"up {STATE} --link-rate 1kbit", message="link rate 1kbit is out of range: from 64kbit to 100gbit"),
    case(f"up {STATE} --mode localhost --link-rate 100mbit", code=NOT_READY, message="a link rate needs nodes"),
    case("link-rate 100mbit --state-dir {tmp}/none", code=NOT_READY, message="no local cluster recorded in"),
    case("link-rate --state-dir {state_recorded} 100mbit", code=NOT_READY, message="a link rate needs nodes"),
    case("link-rate slow --state-dir {tmp}/none", message="invalid link rate 'slow'"),
    case("status --state-dir {file}", message="--state-dir {file} is a file, not a directory"),
    case("status --state-dir {state_not_utf8}", message="local cluster state {state_not_utf8}/state.json is not UTF-8"),
    case("down --state-dir {state_wrong}", message="invalid local cluster state {state_wrong}/state.json"),
    case("up --state-dir {state_recorded}", message="a local cluster is already recorded in"),
    case("up --state-dir {not_empty}", message="--state-dir {not_empty} is not empty"),
    case("", message="error: the following arguments are required: "),
]

DEMO_STATE = "--state-dir {tmp}/demo-state"
DEMO = [
    case(f"{DEMO_STATE} --nodes 0", message="argument --nodes: must be a whole number between 1 and 32, got '0'"),
    case(f"{DEMO_STATE} --nodes 33", message="argument --nodes: must be a whole number between 1 and 32"),
    case(f"{DEMO_STATE} --steps 0", message="argument --steps: must be a whole number >= 1, got '0'"),
    case(f"{DEMO_STATE} --steps many", message="argument --steps: must be a whole number >= 1, got 'many'"),
    case(f"{DEMO_STATE} --batch-size -1", message="argument --batch-size: must be a whole number >= 1, got '-1'"),
    case(f"{DEMO_STATE} --image-size 4", message="argument --image-size: must be a whole number between 8 and"),
    case(f"{DEMO_STATE} --model vgg", message="argument --model: invalid choice: 'vgg'"),
    case(f"{DEMO_STATE} --subnet 8.8.8.0/24", message="subnet 8.8.8.0/24 is not a private IPv4 range"),
    case(f"{DEMO_STATE} --name 1x", message="argument --name: invalid cluster name '1x'"),
    case("--state-dir {file}", message="--state-dir {file} is a file, not a directory"),
    case("--state-dir {state_not_utf8}", message="local cluster state {state_not_utf8}/state.json is not UTF-8"),
]

SAS = {"BLOB_SAS": "sv=2022-11-02&sig=test"}
INTO = "--dest {tmp}/pulled"
BLOB_PULL = [
    case(f"--container-url {{server}}/data {INTO} --workers 0", env=SAS, message="--workers: must be a whole number"),
    case(f"--container-url ftp://host/data {INTO}", env=SAS, message="must be an http(s) URL of a container"),
    case(f"--container-url {{server}} {INTO}", env=SAS, message="must be an http(s) URL of a container"),
    case(f"--container-url '{{server}}/data?sv=1' {INTO}", env=SAS, message="must not carry a query string"),
    case("--container-url {server}/html --dest {file}", env=SAS, message="--dest {file} is a file, not a directory"),
    case(
        "--container-url {server}/html --dest {ro}/pulled",
        env=SAS,
        ro=True,
        message="cannot create --dest {ro}/pulled: Read-only file system",
    ),
    case(f"--container-url {{server}}/html {INTO}", env={"BLOB_SAS": ""}, message="no SAS token: set BLOB_SAS"),
    case(
        f"--container-url {{closed}}/data {INTO}",
        env=SAS,
        code=NOT_READY,
        message="cannot reach {closed}: [Errno 111] Connection refused",
    ),
    case(f"--container-url {{server}}/html {INTO}", env=SAS, message="did not answer with a blob listing"),
    case(
        f"--container-url {{server}}/denied {INTO}",
        env=SAS,
        code=NOT_READY,
        message="blob authorization failed while listing the container: the SAS token is wrong, expired or not",
    ),
    case(f"--container-url {{server}}/gone {INTO}", env=SAS, message="container not found while listing"),
    case("--container-url {server}/data", env=SAS, message="the following arguments are required: --dest"),
]


@pytest.mark.parametrize("bad", STAGE, ids=str)
def test_stage(bad: Case, paths: dict[str, str]) -> None:
    check("dtrain stage", bad, paths)


@pytest.mark.parametrize("bad", CLUSTER, ids=str)
def test_cluster(bad: Case, paths: dict[str, str]) -> None:
    check("dtrain cluster", bad, paths)
    assert not Path(paths["tmp"], "out.json").exists()


@pytest.mark.parametrize("bad", BUILD_IMAGES, ids=str)
def test_images(bad: Case, paths: dict[str, str]) -> None:
    check("dtrain images", bad, paths)


@pytest.mark.parametrize("bad", LAUNCH, ids=str)
def test_launch(bad: Case, paths: dict[str, str]) -> None:
    check("dtrain launch", bad, paths)


def test_a_local_clusters_cpu_nodes_run_as_many_processes_as_their_cpus_under_dry_run(paths: dict[str, str]) -> None:
    proc = run_module("dtrain", "launch", "--cluster", paths["desc_local"], "--framework", "pytorch", "--dry-run",
                      "--gpus-per-node", "2", "--", "--steps", "1")  # fmt: skip
    assert proc.returncode == 0 and "2 processes per node" in proc.stderr, proc.stderr


@pytest.mark.parametrize("bad", JOBS, ids=str)
def test_jobs(bad: Case, paths: dict[str, str]) -> None:
    check("dtrain", bad, paths)


@pytest.mark.parametrize("bad", DRAIN, ids=str)
def test_drain(bad: Case, paths: dict[str, str]) -> None:
    check("dtrain", bad, paths)


@pytest.mark.parametrize("bad", USERS, ids=str)
def test_users(bad: Case, paths: dict[str, str]) -> None:
    check("dtrain users", bad, paths)


@pytest.mark.parametrize("bad", LOCAL_CLUSTER, ids=str)
def test_local_cluster(bad: Case, paths: dict[str, str]) -> None:
    check("dtrain local", bad, paths)
    assert not Path(paths["tmp"], "state").exists()  # refused before anything was created


@pytest.mark.parametrize("bad", DEMO, ids=str)
def test_demo(bad: Case, paths: dict[str, str]) -> None:
    check("dtrain demo", bad, paths)
    assert not Path(paths["tmp"], "demo-state").exists()


@pytest.mark.parametrize("bad", BLOB_PULL, ids=str)
def test_blob_pull(bad: Case, paths: dict[str, str]) -> None:
    proc = check("dtrain.remote.boot.blob_pull", bad, paths)
    if "usage:" not in proc.stderr:  # past argparse, the error is also the JSON line `stage pull` reads back
        assert json.loads(proc.stdout.splitlines()[-1])["error"] in proc.stderr


# --- the one entry point ---------------------------------------------------------------------
COMMANDS = (
    "cluster",
    "users",
    "stage",
    "images",
    "launch",
    "jobs",
    "logs",
    "cancel",
    "status",
    "drain",
    "ui",
    "top",
    "ssh",
    "exec",
    "alloc",
    "results",
    "local",
    "demo",
    "cost",
    "doctor",
)
SUBCOMMANDS = {
    "cluster": ("from-stack", "show", "for-user"),
    "users": ("add", "remove", "limit", "list"),
    "stage": ("generate", "upload", "pull", "all"),
    "local": ("up", "down", "status", "link-rate"),
}


def test_help_lists_every_command():
    proc = run_module("dtrain", "--help", timeout=60)
    assert proc.returncode == 0, proc.stderr
    listed = re.findall(r"^ {4}(\S+) ", proc.stdout, re.MULTILINE)
    assert sorted(listed) == sorted(COMMANDS)
    assert "--cluster" in proc.stdout and "Exit status: 0 ok" in proc.stdout


@pytest.mark.parametrize(
    "words", [(c,) for c in COMMANDS] + [(c, sub) for c, subs in SUBCOMMANDS.items() for sub in subs], ids=" ".join
)
def test_every_command_teaches_with_an_example(words, capsys):
    from dtrain.__main__ import build_parser

    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([*words, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert f"usage: python -m dtrain {' '.join(words)}" in text
    # an example: a command line of its own (not the usage line) that runs this command
    assert re.search(rf"^\s*(examples?:)?\s*python -m dtrain .*\b{words[0]}\b", text, re.MULTILINE), text


@pytest.mark.parametrize("argv", [("nosuchcommand",), ("stage", "nosuchsubcommand"), ()], ids=" ".join)
def test_an_unknown_or_missing_command_is_a_usage_error(argv):
    proc = run_module("dtrain", *argv, timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode == ExitCode.BAD_INPUT
    assert proc.stderr.startswith("usage: python -m dtrain") and "\nerror: " in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout and proc.stdout == ""


@pytest.mark.parametrize("where", ["before", "after"])
def test_cluster_is_taken_before_or_after_the_command(where, paths):
    # $CLUSTER_DESCRIPTION names no file: only the flag can make the command succeed
    flag = ["--cluster", paths["desc"]]
    argv = [*flag, "cluster", "show"] if where == "before" else ["cluster", "show", *flag]
    proc = run_module("dtrain", *argv, env={"CLUSTER_DESCRIPTION": paths["missing"]}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["jump_host"]["host"] == OUTPUTS["jumpbox_public_ip"]


def test_cluster_after_the_command_wins(paths):
    proc = run_module("dtrain", "--cluster", paths["missing"], "cluster", "show", "--cluster", paths["desc"])
    assert proc.returncode == 0, proc.stderr


# --- the safety net and --debug ----------------------------------------------------------------
UNEXPECTED = """
import sys
from dtrain.cli_entry import CLIParser, run_cli

def body(args):
    raise KeyError("boom")

sys.exit(run_cli(CLIParser(prog="tool"), body))
"""


@pytest.mark.parametrize(
    ("flags", "env", "traceback"),
    [((), {}, False), (("--debug",), {}, True), ((), {"SCRIPTS_DEBUG": "1"}, True)],
)
def test_an_unexpected_error_is_a_message_and_the_traceback_only_on_request(flags, env, traceback):
    proc = subprocess.run(
        [sys.executable, "-c", UNEXPECTED, *flags], cwd=REPO, env={"PYTHONPATH": str(REPO), **env},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == ExitCode.FAILED
    assert "error: unexpected KeyError: 'boom'" in proc.stderr
    assert ("Traceback (most recent call last)" in proc.stderr) is traceback
    assert ("(run again with --debug for the traceback)" in proc.stderr) is not traceback


@pytest.mark.parametrize("where", ["before", "between", "after"])
def test_debug_is_accepted_before_and_after_a_subcommand(where, paths):
    args = ["stage", "generate", paths["file"]]
    args.insert({"before": 0, "between": 1, "after": 2}[where], "--debug")
    proc = run_module("dtrain", *args, timeout=60)
    assert proc.returncode == ExitCode.BAD_INPUT
    assert "Traceback (most recent call last)" in proc.stderr and "is a file, not a directory" in proc.stderr


def test_blob_pull_safety_net_and_debug(paths):
    """A listing blob_pull cannot make sense of: an unexpected error, still a message and a status."""
    args = ["--container-url", f"{paths['server']}/odd", "--dest", f"{paths['tmp']}/odd"]
    plain = run_module("dtrain.remote.boot.blob_pull", *args, env=SAS, timeout=60, stdin=subprocess.DEVNULL)
    assert plain.returncode == ExitCode.FAILED and "Traceback" not in plain.stderr
    assert "blob-pull: error: unexpected ValueError" in plain.stderr and "--debug for the traceback" in plain.stderr
    debug = run_module("dtrain.remote.boot.blob_pull", *args, "--debug", env=SAS, timeout=60, stdin=subprocess.DEVNULL)
    assert debug.returncode == ExitCode.FAILED and "Traceback (most recent call last)" in debug.stderr


def test_blob_pull_repeats_the_exit_status_table():
    assert (blob_pull.EXIT_FAILED, blob_pull.EXIT_BAD_INPUT, blob_pull.EXIT_NOT_READY, blob_pull.EXIT_INTERRUPTED) == (
        ExitCode.FAILED,
        ExitCode.BAD_INPUT,
        ExitCode.NOT_READY,
        ExitCode.INTERRUPTED,
    )


def test_the_exit_status_table_is_documented():
    doc = (REPO / "docs" / "operator.md").read_text()
    for code in ExitCode:
        assert re.search(rf"^\| {code.value} \| ", doc, re.MULTILINE), f"exit status {code.value} is not in the table"


def test_a_terminated_command_removes_its_private_ssh_directory(tmp_path: Path) -> None:
    """`kill` (SIGTERM) or a closed terminal (SIGHUP) ends a command as an exception would: the SSH
    configuration it keeps under /tmp goes with it (Python's default would leave it behind)."""
    import signal

    hold = (
        "import sys, tempfile, time\n"
        "from dtrain.cli_entry import end_on_termination\n"
        "end_on_termination()\n"
        "with tempfile.TemporaryDirectory(prefix='hvd-ssh-', dir=sys.argv[1]) as held:\n"
        "    print(held, flush=True)\n"
        "    time.sleep(600)\n"  # a signal not handled would leave it here: the wait below is a hang guard
    )
    for number in (signal.SIGTERM, signal.SIGHUP):
        holder = subprocess.Popen(
            [sys.executable, "-c", hold, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True
        )
        held = Path(holder.stdout.readline().strip())
        assert held.is_dir()
        holder.send_signal(number)
        assert holder.wait(timeout=120) == 128 + number  # at once unloaded; a loaded machine took over 30 s
        assert not held.exists(), f"{held} left behind after {signal.Signals(number).name}"
