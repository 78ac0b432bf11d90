"""launch's checks of the job's inputs, on an Azure description (the local cluster's are exercised by
test_launcher.py against its real login node): what is refused before any connection, and what the
login node is asked to check."""

from __future__ import annotations

import json
import subprocess

import pytest

from dtrain.cluster import description as cl
from dtrain.errors import OperatorError
from dtrain.jobs.launch_request import JobFlags
from dtrain.jobs.preflight import NO_DATA, NO_ENTRYPOINT, ONE_CLASS, plan_preflight

from .conftest import FIXTURES

OUTPUTS = json.loads((FIXTURES / "stack_outputs.json").read_text())


@pytest.fixture(params=["docker", "host"])
def azure(request, tmp_path) -> cl.ClusterDescription:
    return cl.from_stack_outputs(OUTPUTS, "dev", ssh_key="k", known_hosts=tmp_path / "kh", runtime=request.param)


@pytest.mark.parametrize("data_dir", ["/etc", "/shared/data", "/shared/data/../runs/x", "relative/data", "/data"])
def test_data_outside_the_data_path_is_refused_before_connecting(azure, data_dir):
    with pytest.raises(OperatorError, match=r"is not a dataset under the cluster's data path /shared/data") as err:
        plan_preflight(azure, JobFlags(data_dir=data_dir), entrypoint=None, model_parallel=False)
    assert err.value.exit_code == 2


def test_our_jobs_flags_are_read_once_as_argparse_would_read_them():
    job = JobFlags.read(
        ["--backend=ddp", "--data-dir", "/shared/data/a", "--data", "imagenet", "--data-dir=/shared/data/b"]
    )
    assert job == JobFlags(backend="ddp", data="imagenet", data_dir="/shared/data/b")  # the last one wins
    assert JobFlags.read(["--steps", "10", "--data-dir"]) == JobFlags()  # a flag without its value: not given


def run_checks(script: str) -> int:
    return subprocess.run(["bash", "-c", f"{script}exit 0"], capture_output=True).returncode


def test_the_login_node_checks_the_dataset_and_its_classes(tmp_path):
    desc = cl.from_stack_outputs({**OUTPUTS, "data_path": str(tmp_path)}, "dev", ssh_key="k", known_hosts="kh")
    data = tmp_path / "mini"
    checks = plan_preflight(desc, JobFlags(data="imagenet", data_dir=str(data)), entrypoint=None, model_parallel=False)
    assert run_checks(checks.script) == NO_DATA
    (data / "train" / "n0").mkdir(parents=True)
    assert run_checks(checks.script) == ONE_CLASS
    assert "has one class folder under train/" in str(checks.refusal(ONE_CLASS))
    (data / "train" / "n1").mkdir()
    assert run_checks(checks.script) == 0
    synthetic = plan_preflight(desc, JobFlags(data_dir=str(data / "x")), entrypoint=None, model_parallel=False)
    assert ONE_CLASS not in synthetic.codes  # no class check unless the job reads ImageNet


def test_an_entrypoint_on_the_shared_file_system_is_checked_one_in_an_image_is_not(azure):
    on_share = plan_preflight(azure, JobFlags(), entrypoint="/shared/code/train.py", model_parallel=False)
    assert run_checks(on_share.script) == NO_ENTRYPOINT
    assert str(on_share.refusal(NO_ENTRYPOINT)).startswith("--entrypoint /shared/code/train.py: ")
    relative = plan_preflight(azure, JobFlags(), entrypoint="train.py", model_parallel=False)
    # host runtime: the workdir is on the share, so a relative script is checked there
    assert bool(relative.codes) is (azure.runtime.kind == "host")
    assert not plan_preflight(azure, JobFlags(), entrypoint="my.module", model_parallel=False).codes
