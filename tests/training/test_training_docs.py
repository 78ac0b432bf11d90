"""docs/training.md keeps up with the code: every flag, metric and failure timeout is described."""

from __future__ import annotations

import pytest

from tests.training.jobs import REPO
from training.args import FRAMEWORKS, build_parser
from training.distributed import FAILURE_TIMEOUTS
from training.metrics import METRIC_KEYS

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
