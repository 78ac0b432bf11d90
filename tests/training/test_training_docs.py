"""docs/training.md keeps up with the code: every flag, metric, failure timeout and exit status is described."""

from __future__ import annotations

import pytest

from tests.training.jobs import REPO
from training.config.args import FRAMEWORKS, build_parser
from training.errors import ExitCode
from training.run.metrics import METRIC_KEYS
from training.run.outputs import DEFAULT_MIN_FREE_MB, MIN_FREE_ENV
from training.world.distributed import FAILURE_TIMEOUTS, PEER_TIMEOUT_SECONDS
from training.world.liveness import PROBE_TIMEOUT_SECONDS

DOC = (REPO / "docs" / "training.md").read_text()


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_every_flag_is_in_the_flags_table(framework: str) -> None:
    flags = [o for action in build_parser(framework)._actions for o in action.option_strings if o.startswith("--")]
    missing = [flag for flag in flags if flag != "--help" and f"| `{flag}" not in DOC]
    assert not missing, f"flags not documented in docs/training.md: {missing}"


def test_every_metric_and_timeout_is_documented() -> None:
    assert [key for key in METRIC_KEYS if f"| `{key}` |" not in DOC] == []
    for name, default in FAILURE_TIMEOUTS.items():
        assert f"`{name}` ({default})" in DOC, name


def test_exit_statuses_and_bounds_are_documented() -> None:
    assert [code for code in ExitCode if f"\n| {code.value} | " not in DOC] == []
    assert f"`{MIN_FREE_ENV}` MiB free (default {DEFAULT_MIN_FREE_MB}" in DOC
    assert f"in both backends: **{PEER_TIMEOUT_SECONDS} s**" in DOC
    assert f"pings its peers for up to {PROBE_TIMEOUT_SECONDS:g} s" in DOC
