"""`dtrain launch task.yaml`: a task file (SkyPilot's keys, and a few of ours) read into a typed Task, checked
against its schema, and merged into the launch request (dtrain/jobs/launch_request.py) that the command line
made. Runs on the operator's machine.

    name: my-model                 # the run id's prefix
    workdir: .                     # relative to the task file's directory
    num_nodes: 2                   # or resources.nodes
    setup: pip install -r requirements.txt   # once per node, skipped when the code and setup are unchanged
    run: torchrun --nproc-per-node "$DTRAIN_PROCESSES_PER_NODE" ... train.py
    envs: {EPOCHS: 2}
    secrets: [HF_TOKEN]            # values from the operator's environment at launch, never written down
    mode: per-node                 # run once per node (your launcher), or per-rank (ours)
    resources: {accelerators: H100:8, time: "4:00:00", use_spot: false}   # or gpus: 8, spot, image

SkyPilot's keys that this cluster cannot honour are refused, each naming why (dtrain/jobs/skypilot_keys.py);
what its resources ask of the nodes is checked against the cluster (dtrain/jobs/cluster_fit.py). Flags given
on the command line win over the file's keys; `--env` and `--secret` add to its `envs` and `secrets`. PyYAML
reads it with YAML 1.2's numbers, so `time: 1:00:00` stays a time, not 3600.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator, model_validator

from dtrain.checks import describe_validation_error
from dtrain.cluster.slurm_time import check_time_limit
from dtrain.errors import OperatorError, explain_os_error
from dtrain.jobs import skypilot_keys
from dtrain.jobs.cluster_fit import ClusterNeeds
from dtrain.jobs.launch_request import LaunchRequest
from dtrain.jobs.launcher_guard import check_launcher_mode

TASK_SUFFIXES = (".yaml", ".yml")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
Mode = Literal["per-rank", "per-node"]
# What job.sh and the launchers set, and what its own tools need (PATH): not for envs or secrets
RESERVED_NAMES = frozenset(
    ("PATH", "RUN_DIR", "RUN_ID", "OUTPUT_DIR", "CHECKPOINT_DIR", "GIT_REVISION", "MASTER_ADDR", "MASTER_PORT")
)
RESERVED_PREFIXES = ("DTRAIN_", "SKYPILOT_", "SLURM_", "TORCHELASTIC_")
# Names that hold credentials by convention (HF_TOKEN, MLFLOW_TRACKING_TOKEN, MLFLOW_TRACKING_PASSWORD,
# AZURE_CLIENT_SECRET, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, AZURE_STORAGE_CONNECTION_STRING): a word (between
# underscores) TOKEN, SECRET, PASSWORD, PASSWD or CREDENTIAL(S), or a name that ends in _KEY or
# _CONNECTION_STRING, in any case. Not for envs, whose values job.sh and job.json keep: secrets only.
CREDENTIAL_NAME = re.compile(
    r"(?:^|_)(?:TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?)(?:_|$)|_KEY$|_CONNECTION_STRING$", re.IGNORECASE
)
# MLflow's variables are the job's (--tracking-uri, --experiment, the run it opens); a server's token is
# the one a secret may carry, which remote/job/mlflow_run.py reads from the run's secrets itself.
MLFLOW_PREFIX = "MLFLOW_"
MLFLOW_TOKEN = "MLFLOW_TRACKING_TOKEN"
# envs are exported by job.sh, so the job's own tools (results upload, MLflow, checkpoint mirror, the log
# annotator) run with them too: these change what a Python imports (PYTHONPATH=. puts the code's json.py
# before the standard library's), which libraries load, or where HTTP goes (a proxy for pip cannot reach
# the head node's MLflow). Refused, not isolated: a command that needs one sets it itself. Secrets are
# sourced in the user's command only, so they may use these names.
TOOL_BREAKING_NAMES = frozenset(
    (
        *("PYTHONHOME", "PYTHONPATH", "PYTHONPLATLIBDIR", "PYTHONUSERBASE", "LD_PRELOAD", "LD_LIBRARY_PATH"),
        *("SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE"),
        *("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"),  # any case: curl and Python read http_proxy too
    )
)
# Linux refuses an argument or environment string ("NAME=value") of 128 KiB or more (MAX_ARG_STRLEN: every
# command then fails with "Argument list too long"), and horovodrun forwards its whole environment to each
# worker inside one ssh command string, which Slurm's and the job's own variables (a few KiB) share: the
# envs and secrets of a job hold at most half of that string.
ENVIRONMENT_BUDGET = 64 * 1024
T = TypeVar("T")
EnvName = Annotated[str, StringConstraints(pattern=f"^{ENV_NAME.pattern}$")]
RunName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9._-]{1,60}$")]


class _Strict(BaseModel):
    # strict: `nodes: true` or `nodes: "2"` is a mistake to name, not a value to convert (true would be 1)
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _reader(parse: Callable[[Any], object], empty: object = None) -> Any:
    """A field's validator that reads SkyPilot's form of its value (dtrain/jobs/skypilot_keys.py); an empty
    key (`cpus:`) is not given."""
    return classmethod(lambda cls, value: empty if value is None else parse(value))


class Resources(_Strict):
    nodes: Annotated[int, Field(ge=1)] | None = None
    gpus: Annotated[int, Field(ge=1)] | None = None  # per node, as SkyPilot's accelerators count
    time: str | int | None = None  # Slurm's --time syntax; a bare number is minutes
    spot: bool = False
    image: Annotated[str, Field(min_length=1)] | None = None
    # SkyPilot's, in its forms (dtrain/jobs/skypilot_keys.py); what they ask of the nodes: cluster_fit.py
    accelerators: tuple[tuple[str, int], ...] = ()  # (name, count per node) candidates
    cpus: float | None = None  # the least a node has
    memory: float | None = None  # GiB, the least a node has
    disk_size: float | None = None  # GiB, the least a node's OS disk has
    use_spot: bool = False
    image_id: str | None = None  # the container image (docker:REF's REF)
    instance_type: Annotated[str, Field(min_length=1)] | None = None
    network_tier: Literal["standard", "best"] | None = None
    cloud: str | None = None
    region: Annotated[str, Field(min_length=1)] | None = None
    infra: str | None = None  # CLOUD[/REGION]

    @field_validator("time")
    @classmethod
    def _time(cls, value: str | int | None) -> str | None:
        try:
            return None if value is None else check_time_limit(str(value))
        except OperatorError as exc:
            raise ValueError(str(exc)) from None

    _accelerators = field_validator("accelerators", mode="before")(_reader(skypilot_keys.parse_accelerators, ()))
    _cpus = field_validator("cpus", mode="before")(_reader(skypilot_keys.parse_cpus))
    _memory = field_validator("memory", mode="before")(_reader(skypilot_keys.parse_size_gib))
    _disk = field_validator("disk_size", mode="before")(_reader(skypilot_keys.parse_disk_gib))
    _image_id = field_validator("image_id", mode="before")(_reader(skypilot_keys.parse_image_id))
    _cloud = field_validator("cloud")(_reader(skypilot_keys.check_cloud))

    @field_validator("infra")
    @classmethod
    def _infra(cls, value: str) -> str:
        skypilot_keys.check_cloud(skypilot_keys.parse_infra(value)[0])
        return value

    @model_validator(mode="after")
    def _one_key_each(self) -> Resources:
        """Ours and SkyPilot's key for the same thing: which would win is not obvious, so one of them goes."""
        given = self.model_fields_set
        for ours, theirs in (("gpus", "accelerators"), ("spot", "use_spot"), ("image", "image_id"), ("cloud", "infra")):
            if ours in given and theirs in given:
                raise ValueError(f"{ours} and {theirs} say the same thing: keep one")
        if "region" in given and "infra" in given:
            raise ValueError("region and infra both say where: keep one")
        return self

    def needs(self, mounts: tuple[tuple[str, str], ...], task_file: str) -> ClusterNeeds:
        cloud, region = skypilot_keys.parse_infra(self.infra) if self.infra else (self.cloud, self.region)
        return ClusterNeeds(
            accelerators=self.accelerators, cpus=self.cpus, memory_gib=self.memory, disk_gib=self.disk_size,
            instance_type=self.instance_type, network_tier=self.network_tier, cloud=cloud and cloud.lower(),
            region=region, mounts=mounts, task_file=task_file,
        )  # fmt: skip


class Task(_Strict):
    name: RunName | None = None
    workdir: Annotated[str, Field(min_length=1)] | None = None
    num_nodes: Annotated[int, Field(ge=1)] | None = None  # SkyPilot's resources.nodes
    setup: str | None = None
    run: Annotated[str, Field(min_length=1)] | None = None
    envs: dict[EnvName, str | None] = {}  # None: required, from --env (a credential's name: a secret)
    secrets: list[EnvName] = []
    mode: Mode | None = None
    resources: Resources = Resources()
    file_mounts: tuple[tuple[str, str], ...] = ()  # staged datasets: (path on the nodes, source URL)

    @field_validator("workdir", mode="before")
    @classmethod
    def _workdir(cls, workdir: object) -> object:
        if isinstance(workdir, dict):
            raise ValueError("a git repository (url, ref): clone it, and name the directory")
        return workdir

    _file_mounts = field_validator("file_mounts", mode="before")(_reader(skypilot_keys.parse_file_mounts, ()))

    @field_validator("envs", mode="before")
    @classmethod
    def _env_text(cls, envs: object) -> object:
        """Numbers and booleans as the shell will see them (true, not True); empty (null) stays None."""
        if not isinstance(envs, dict):
            return envs
        for key, value in envs.items():
            if value is not None and not isinstance(value, str | int | float | bool):
                raise ValueError(f"{key}: a value must be text, a number or true/false")
        return {key: _shell_text(value) for key, value in envs.items()}

    @field_validator("secrets", mode="before")
    @classmethod
    def _secret_names(cls, secrets: object) -> object:
        """SkyPilot's map form, `NAME: null`, is a list of names: a value in the file is refused."""
        if not isinstance(secrets, dict):
            return secrets
        given = [name for name, value in secrets.items() if value is not None]
        if given:
            raise ValueError(
                f"{given[0]}: leave the value empty (null): a secret's value is read from your environment at "
                "launch, never from the task file"
            )
        return list(secrets)

    @property
    def in_skypilot_dialect(self) -> bool:
        """Whether the file uses a key only SkyPilot has, or its run reads SkyPilot's variables: then its run
        is meant to run once per node, as SkyPilot runs it."""
        own = {"num_nodes", "file_mounts"} & self.model_fields_set
        resources = set(skypilot_keys.SKYPILOT_RESOURCES) & self.resources.model_fields_set
        return bool(own or resources) or skypilot_keys.reads_skypilot_variables(self.run)


def _shell_text(value: str | int | float | bool | None) -> str | None:
    if value is None:
        return None
    return str(value).lower() if isinstance(value, bool) else str(value)


_MERGE = "tag:yaml.org,2002:merge"


class _Yaml12Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2's integers and floats (YAML 1.1 reads `1:00:00` as 3600, base 60) and its
    unique keys: PyYAML keeps the last of two `run:` keys without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        seen: set[Hashable] = set()
        for key_node, _ in node.value:
            if key_node.tag == _MERGE:  # `<<: *base`: its keys are meant to be overridden
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (the second would replace the first: keep one)",
                    key_node.start_mark,
                )  # fmt: skip
            if isinstance(key, Hashable):
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


_NUMBERS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in _NUMBERS]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^[-+]?[0-9]+$"), list("-+0123456789"))
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?([0-9]+\.[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$"), list("-+.0123456789")
)


def is_task_file(word: str) -> bool:
    return word.lower().endswith(TASK_SUFFIXES)  # task.YAML too: file names on Windows and macOS keep any case


def load_task(path: str) -> Task:
    """The task file, checked: one `error: FILE: key: problem` line for what is wrong, nothing else done."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as exc:
        raise explain_os_error(exc, "read the task file") from None
    except UnicodeDecodeError:
        raise OperatorError(f"{path}: not UTF-8 text") from None
    try:
        data = yaml.load(text, Loader=_Yaml12Loader)  # a SafeLoader
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise OperatorError(f"{path}: not YAML{where}: {getattr(exc, 'problem', None) or exc}") from None
    if not isinstance(data, dict):
        raise OperatorError(f"{path}: expected a mapping of keys (name, workdir, setup, run, envs, ...)")
    if refused := skypilot_keys.refused_key(data):  # SkyPilot's, and not for this cluster: named with why
        raise OperatorError(f"{path}: {refused}")
    try:
        return Task.model_validate(data)
    except ValidationError as exc:
        raise OperatorError(f"{path}: {describe_validation_error(exc)}") from None


def parse_env(text: str) -> tuple[str, str]:
    """--env KEY=VALUE."""
    key, sep, value = text.partition("=")
    if not sep or not ENV_NAME.fullmatch(key):
        raise OperatorError(f"expected KEY=VALUE with KEY a variable name, got {text!r}")
    return key, value


def env_name(text: str) -> str:
    """--secret NAME."""
    if not ENV_NAME.fullmatch(text):
        raise OperatorError(f"expected a variable name (letters, digits, _), got {text!r}")
    return text


def with_task(request: LaunchRequest, task: Task, path: str) -> LaunchRequest:
    """The request with the task's keys where the command line left a flag unset: flags win, --env/--secret
    add. A file in SkyPilot's dialect runs per node unless it says `mode:` (SkyPilot runs `run` once on each
    node)."""
    base = Path(path).expanduser().resolve().parent
    resources = task.resources
    if task.num_nodes is not None and resources.nodes is not None:
        raise OperatorError(f"{path}: num_nodes and resources.nodes say the same thing: keep one")
    envs, required = _envs(task.envs, request.envs, path)
    per_node_gpus = None if request.gpus is not None else resources.gpus  # --gpus (in all) leaves it out
    merged = replace(
        request,
        workdir=_unless_given(request.workdir, task.workdir and str(base / task.workdir)),
        nodes=_unless_given(request.nodes, task.num_nodes or resources.nodes),
        processes_per_node=_unless_given(request.processes_per_node, per_node_gpus),
        time_limit=_unless_given(request.time_limit, resources.time),
        image=_unless_given(request.image, resources.image or resources.image_id),
        mode=_unless_given(request.mode, task.mode or ("per-node" if task.in_skypilot_dialect else None)),
        name=_unless_given(request.name, task.name),
        setup=_unless_given(request.setup, task.setup),
        spot=request.spot or ((resources.spot or resources.use_spot) and not request.spot_fallback),
        needs=resources.needs(task.file_mounts, path),
        envs=envs,
        secrets=tuple(dict.fromkeys([*task.secrets, *required, *request.secrets])),
        job_args=request.job_args or (("bash", "-c", task.run) if task.run else ()),
    )
    if not merged.workdir:
        raise OperatorError(f"{path}: workdir: needed (the directory your code is in, relative to the task file)")
    if not merged.job_args:
        raise OperatorError(f"{path}: run: needed (the command that starts your code), or a command after --")
    return merged


def _unless_given(flag: T | None, value: T | None) -> T | None:
    """A flag's value where the command line gave it, else the task file's."""
    return value if flag is None else flag


def _envs(envs: dict[str, str | None], flags: dict[str, str], path: str) -> tuple[dict[str, str], list[str]]:
    """The file's envs with the --env flags over them, and the secrets that its empty credentials become.
    An empty env (SkyPilot's `NAME: null`, "required") needs --env NAME=VALUE; one whose name says it holds a
    credential (HF_TOKEN) is read as a secret from the environment, as SkyPilot's `--env HF_TOKEN` reads it,
    and never written down."""
    required = [name for name, value in envs.items() if value is None and name not in flags]
    secrets = [name for name in required if CREDENTIAL_NAME.search(name)]
    if missing := [name for name in required if name not in secrets]:
        raise OperatorError(f"{path}: envs.{missing[0]}: required (empty in the file): pass --env {missing[0]}=VALUE")
    return {**{name: value for name, value in envs.items() if value is not None}, **flags}, secrets


def read_secrets(names: Sequence[str]) -> dict[str, str]:
    """The secrets' values from the operator's environment; a missing one is an error naming it."""
    missing = [name for name in names if name not in os.environ]
    if missing:
        raise OperatorError(
            f"secret {', '.join(missing)}: not set in this environment (export {missing[0]}=... before launch; "
            "secrets are read from the operator's environment, never from a file or the command line)"
        )
    return {name: os.environ[name] for name in names}


def refuse_credentials_in_envs(envs: dict[str, str]) -> None:
    """An env (--env, a task file's envs) whose name says it holds a credential: its value would be in
    job.sh and job.json, which are uploaded. It goes as a secret, which is never written down."""
    for name in envs:
        if CREDENTIAL_NAME.search(name):
            raise OperatorError(
                f"{name}: a credential's name (docs/operator.md, Secrets): as an env (--env, envs) its value would "
                f"be written to job.sh and job.json; pass it as a secret: export {name}=... and --secret {name} "
                "(or the task file's secrets)"
            )


def check_task_request(
    *,
    workdir: str | None,
    command: Sequence[str],
    mode: str | None,
    launcher: str | None,
    setup: str | None,
    envs: dict[str, str],
    secrets: Sequence[str],
    nodes: int = 1,
) -> None:
    """What a task's keys (or their flags) need: your own code for per-node mode and setup, variables
    that do not replace the job's own, a command that does not start a launcher per rank, and one that
    per node joins the nodes into one world."""
    refuse_credentials_in_envs(envs)  # first: a token given as an env is told where it belongs
    check_variable_names(envs, secrets)
    if both := sorted(set(envs) & set(secrets)):
        raise OperatorError(f"{both[0]}: both an env and a secret: keep one")
    if not workdir:
        for given, what in ((mode == "per-node", "--mode per-node"), (setup, "setup")):
            if given:
                raise OperatorError(f"{what} runs your own code: add --workdir (task file: workdir)")
        return
    if mode == "per-node" and launcher:
        raise OperatorError(f"--mode per-node runs your command as the launcher: leave out --launcher {launcher}")
    check_launcher_mode(command, mode or "per-rank", "--mode per-node (task file: mode: per-node)", nodes, envs)


def check_variable_names(envs: dict[str, str], secrets: Sequence[str]) -> None:
    """Names the job or its own tools depend on: the job sets them, or they would change our tools too."""
    for name in [*envs, *secrets]:
        if name in RESERVED_NAMES or name.startswith(RESERVED_PREFIXES):
            raise OperatorError(f"{name}: the job sets this variable itself (docs/operator.md): choose another name")
        if name.startswith(MLFLOW_PREFIX) and not (name == MLFLOW_TOKEN and name in secrets):
            raise OperatorError(
                f"{name}: the job sets MLflow's variables itself (--tracking-uri, --experiment); a server's token "
                f"is the secret {MLFLOW_TOKEN} (docs/operator.md)"
            )
    for name in envs:
        if name.upper() in TOOL_BREAKING_NAMES:
            raise OperatorError(
                f"{name}: an env reaches the job's own tools too (results upload, MLflow, the log), which it would "
                f"change: set it in your command instead (run: export {name}=...; ..., or env {name}=... COMMAND)"
            )


def check_environment_size(values: dict[str, str]) -> None:
    """envs and secrets (name -> value) within what every command of the job can carry (ENVIRONMENT_BUDGET)."""
    sizes = {name: len(f"{name}={value}".encode()) for name, value in values.items()}
    largest = max(sizes, key=sizes.__getitem__, default=None)
    limit = (
        f"a job's envs and secrets hold at most {ENVIRONMENT_BUDGET // 1024} KiB in all (docs/operator.md): "
        "put large values in a file in the workdir and pass its path"
    )
    if largest is not None and sizes[largest] > ENVIRONMENT_BUDGET:
        raise OperatorError(f"{largest}: {sizes[largest] / 1024:,.1f} KiB; {limit}")
    if (total := sum(sizes.values())) > ENVIRONMENT_BUDGET:
        raise OperatorError(f"envs and secrets: {total / 1024:,.1f} KiB together; {limit}")
