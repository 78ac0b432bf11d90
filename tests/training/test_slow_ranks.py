"""Slow ranks (training/run/slow_ranks.py): the decision as a pure function of each window's figures, rank 0's
sliding window, log lines and file, the PyTorch clock, and a real 2-rank job whose rank 1 is put under a CPU
limit from outside (a cgroup of its own) and is named, with its host, in the log and in --slow-ranks-json."""

from __future__ import annotations

import json
import logging
import re
import socket
import time
from pathlib import Path

import pytest
import torch

from tests.cpu_limit import cgroup_cpu_problem, cpu_limited
from tests.polling import wait_for
from training.run.slow_ranks import (
    CLEAR_FACTOR,
    CLEAR_FOR_S,
    MARK,
    SLOW_FACTOR,
    SLOW_FOR_S,
    WINDOW_S,
    SlowRankWatch,
    Standing,
    judge,
)
from training.torch.compute_clock import ComputeClock

from .jobs import LEFTOVER_MARKER, horovodrun, kill_tree, start, worker_pid

NOW = "2026-12-07T10:00:00Z"
# judged every WINDOW_S, windows in a row: how many make the time each rule asks
SLOW_WINDOWS = int(SLOW_FOR_S / WINDOW_S) + 1
CLEAR_WINDOWS = int(CLEAR_FOR_S / WINDOW_S) + 1


def run_windows(windows: list[list[float | None]], peers: list[str] | None = None) -> list[dict[int, Standing]]:
    """judge() over windows one after the other (window i ends at second and step 10 * (i + 1)): the
    standings after each."""
    standings: dict[int, Standing] = {}
    history = []
    for index, figures in enumerate(windows):
        standings = judge(standings, figures, WINDOW_S * (index + 1), 10 * (index + 1), NOW, peers)
        history.append(standings)
    return history


def slow(standings: dict[int, Standing]) -> list[int]:
    return [rank for rank, standing in sorted(standings.items()) if standing.slow]


# --- the decision ---------------------------------------------------------------------------------
def test_a_rank_above_the_factor_for_the_windows_in_a_row_is_slow_and_no_sooner():
    slow_window = [0.1, 0.1, 0.1, 0.1 * SLOW_FACTOR * 1.1]
    history = run_windows([slow_window] * SLOW_WINDOWS)
    assert [slow(h) for h in history] == [[]] * (SLOW_WINDOWS - 1) + [[3]]
    named = history[-1][3]
    assert named.since_step == 10 and named.since == NOW and named.above_since == WINDOW_S
    assert named.median_s == pytest.approx(0.1) and named.ratio == pytest.approx(SLOW_FACTOR * 1.1)


def test_far_outside_the_noise_two_windows_are_enough():
    clear = [0.1, 0.1 * CLEAR_FACTOR * 1.1]
    history = run_windows([clear] * CLEAR_WINDOWS)
    assert [slow(h) for h in history] == [[]] * (CLEAR_WINDOWS - 1) + [[1]]
    # above the factor, then far above it: the far windows must come in a row
    history = run_windows([[0.1, 0.1 * CLEAR_FACTOR * 1.1], [0.1, 0.2], [0.1, 0.1 * CLEAR_FACTOR * 1.1]])
    assert [slow(h) for h in history] == [[], [], [1]]  # by then, 3 windows above SLOW_FACTOR
    history = run_windows([[0.1, 0.1 * CLEAR_FACTOR * 1.1], [0.1, 0.1], [0.1, 0.1 * CLEAR_FACTOR * 1.1]])
    assert [slow(h) for h in history] == [[], [], []]


def test_a_noisy_window_between_slow_ones_starts_the_count_again():
    fast, above = [0.1, 0.1, 0.1], [0.1, 0.1, 0.2]
    history = run_windows([above, above, fast, above, above, above])
    assert [slow(h) for h in history] == [[], [], [], [], [], [2]]
    assert history[-1][2].since_step == 40  # the streak that named it


def test_a_slow_rank_recovers_after_as_many_windows_under_the_factor_and_keeps_its_start_meanwhile():
    above, fast = [0.1, 0.3], [0.1, 0.1]
    history = run_windows([above] * 3 + [fast, fast, above, fast, fast, fast])
    assert [bool(slow(h)) for h in history] == [False, False, True, True, True, True, True, True, False]
    assert history[5][1].since_step == 10  # slow all along: the time it was first seen
    assert history[-1][1].since_step is None and history[-1][1].ratio == pytest.approx(1.0)


def test_two_ranks_only_the_slower_one_and_the_factor_is_strict():
    history = run_windows([[0.2, 0.1]] * SLOW_WINDOWS)
    assert slow(history[-1]) == [0]
    at_the_factor = run_windows([[0.1 * SLOW_FACTOR, 0.1]] * SLOW_WINDOWS)
    assert slow(at_the_factor[-1]) == []


def test_a_window_without_a_figure_is_no_evidence_either_way_and_one_rank_alone_is_never_judged():
    above, missing, fast = [0.1, 0.3], [0.1, None], [0.1, 0.1]
    history = run_windows([above, missing, above])  # the time above runs on: nothing said it ended
    assert [slow(h) for h in history] == [[], [], [1]]
    assert history[1][1] == history[0][1]
    history = run_windows([above, missing, fast, above])
    assert [slow(h) for h in history] == [[], [], [], []]
    assert slow(run_windows([[5.0]] * 10)[-1]) == []


def test_the_median_of_the_others_resists_one_fast_outlier_and_tiny_excesses_are_noise():
    # rank 0 is fast by luck (its data in cache): the others are not slow against the median of the others
    assert slow(run_windows([[0.01, 0.1, 0.1, 0.11]] * 5)[-1]) == []
    # 1 ms steps: twice as long is still under the minimum excess a step (timer and scheduling noise)
    assert slow(run_windows([[0.001, 0.001, 0.002]] * 5)[-1]) == []


def test_ranks_are_compared_with_their_peers_only():
    # a pipeline's two stages do different work: the heavy stage is not slow, its slow replica is
    figures = [0.1, 0.1, 0.3, 0.6]
    history = run_windows([figures] * SLOW_WINDOWS, ["a", "a", "b", "b"])
    assert slow(history[-1]) == [3]


# --- rank 0's windows, lines and file -------------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_watch_adds_log_steps_into_windows_names_and_clears_once_and_writes_its_file(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="training.run.slow_ranks")
    path, clock = tmp_path / "run" / "slow_ranks.json", FakeClock()
    path.parent.mkdir()
    path.write_text('{"slow": [{"rank": 5, "host": "old-attempt"}]}')
    watch = SlowRankWatch(path, clock=clock)
    assert json.loads(path.read_text())["slow"] == []  # a requeued attempt starts clean
    hosts = ["node-0", "node-1"]
    step = 0

    def log_steps(compute: tuple[float, float], count: int) -> None:
        nonlocal step
        for _ in range(count):  # each log step: 10 steps, 2.5 s of the window
            step += 10
            clock.now += WINDOW_S / 4
            watch.observe(step, [(compute[0] * 10, 10), (compute[1] * 10, 10)], hosts)

    # judged at each log step once the first has WINDOW_S behind it (the 5th), named SLOW_FOR_S later
    log_steps((0.31, 0.52), 4 * SLOW_WINDOWS)
    assert MARK not in caplog.text  # one log step short
    log_steps((0.31, 0.52), 1)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(MARK)]
    assert lines == ["[slow rank] rank 1 on node-1: compute 0.52 s/step, 1.7x the median 0.31 s (for 20 s)"]
    document = json.loads(path.read_text())
    assert document["step"] == step and document["factor"] == SLOW_FACTOR
    [entry] = document["slow"]
    assert (entry["rank"], entry["host"], entry["since_step"]) == (1, "node-1", 50)
    assert entry["compute_s"] == pytest.approx(0.52) and entry["ratio"] == pytest.approx(0.52 / 0.31, abs=1e-3)
    assert not list(path.parent.glob(".*tmp*"))  # written through a temporary file, renamed
    log_steps((0.31, 0.52), 8)  # still slow: nothing more said
    log_steps((0.31, 0.25), 4 * SLOW_WINDOWS)  # the window slides off the slow steps in a log step or two
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(MARK)]
    assert len(lines) == 2 and re.match(
        r"\[slow rank\] rank 1 on node-1 recovered: .* \(slow since step 50\)$", lines[1]
    )
    assert json.loads(path.read_text())["slow"] == []


def test_the_window_slides_with_the_log_steps_so_a_sudden_slowdown_is_named_as_soon_as_the_rule_allows(tmp_path):
    clock, every_s = FakeClock(), 3.0
    watch = SlowRankWatch(tmp_path / "s.json", clock=clock)
    named_at = None
    for index in range(40):
        clock.now += every_s
        cut = clock.now > 30.0  # rank 1 computes 10 times longer from the log step at 33 s on
        watch.observe(index, [(0.1, 1), (1.0 if cut else 0.1, 1)], ["node-0", "node-1"])
        if named_at is None and watch.standings.get(1, Standing()).slow:
            named_at = clock.now
    # far outside the noise from its first slow log step on: CLEAR_FOR_S later, to the next log step
    assert named_at is not None and 33.0 + CLEAR_FOR_S <= named_at <= 33.0 + CLEAR_FOR_S + every_s, named_at
    assert not watch.standings[0].slow


def test_a_run_that_cannot_compare_its_ranks_says_why_once_and_judges_nothing(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="training.run.slow_ranks")
    clock = FakeClock()
    watch = SlowRankWatch(tmp_path / "s.json", why_not="on pp 2 each rank's forward pass waits", clock=clock)
    for step in range(1, 20):
        clock.now += WINDOW_S
        watch.observe(step, [(1.0, 1), (9.0, 1)], ["a", "b"])
    assert caplog.text.count(MARK) == 1 and "not checked: on pp 2" in caplog.text
    assert json.loads((tmp_path / "s.json").read_text())["slow"] == []


def test_the_pytorch_clock_spans_the_wait_for_the_batch_and_the_forward_pass():
    clock = ComputeClock(torch.device("cpu"))
    for _ in clock.fetching(range(3)):
        clock.end()
    seconds, steps = clock.take_window()
    assert steps == 3 and seconds >= 0
    assert clock.take_window() is None  # taken: the next window starts empty


@pytest.mark.gpu
def test_the_cuda_clock_times_the_device_without_waiting_for_it_at_each_step():
    """Events on the stream, no synchronisation per step (the sync debug mode raises on one); read once at
    the end, after the loop's own wait, their span is the device's time for the work between them."""
    device = torch.device("cuda")
    clock = ComputeClock(device)
    a = torch.randn(2048, 2048, device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in clock.fetching(range(20)):
            for _ in range(5):
                a = (a @ a).tanh()
            clock.end()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    started = time.perf_counter()
    torch.cuda.synchronize()  # the loop's wait at a log step
    seconds, steps = clock.take_window()
    assert steps == 20 and seconds > 0
    assert time.perf_counter() - started < 60
    for _ in clock.fetching(range(3)):  # the events are reused, not made again
        clock.end()
    torch.cuda.synchronize()
    assert clock.take_window()[1] == 3


def test_the_model_parallel_job_compares_ranks_only_under_pure_replication():
    from training.config.layout import Layout
    from training.model_parallel import unchecked_layout

    assert unchecked_layout(Layout(dp_replicate=4)) is None and unchecked_layout(Layout()) is None
    for layout in (Layout(dp_shard=2), Layout(tp=2), Layout(pp=2), Layout(dp_replicate=2, dp_shard=2)):
        assert "slows its group alike" in (unchecked_layout(layout) or ""), layout


# --- a real job -----------------------------------------------------------------------------------
@pytest.mark.skipif(cgroup_cpu_problem() is not None, reason=str(cgroup_cpu_problem()))
@pytest.mark.parametrize("framework", ["pytorch", "keras"])
def test_a_rank_under_a_cpu_limit_is_named_with_its_host_while_the_job_runs(tmp_path, framework):
    """2 ranks (horovodrun, gloo); once both step, rank 1 alone gets 3 % of a CPU through a cgroup of its own.
    Its compute takes many times the other rank's, where the loaded machine's noise stays under 1.5x over
    a 10 s window: rank 1 is named within a few windows, rank 0 never. PyTorch's clock (ComputeClock) and
    TensorFlow's (forward_done in Keras's train_step, which the custom loop shares)."""
    report = tmp_path / "slow_ranks.json"
    args = [*SLOW_JOB, "--slow-ranks-json", report]
    log = tmp_path / "job.log"
    job = start(horovodrun(2, framework, *args), log, {LEFTOVER_MARKER: "slow-rank-test"})
    try:
        wait_for(lambda: "step 20/" in log.read_text(), 240, "the first log steps", interval=0.5)
        with cpu_limited([worker_pid(job, 1, f"training.{framework}")], 3):
            named = wait_for(lambda: _named(report), 180, "rank 1 named in --slow-ranks-json", interval=1)
        assert [entry["rank"] for entry in named] == [1], named
        assert named[0]["host"] == socket.gethostname().split(".")[0] and named[0]["ratio"] > SLOW_FACTOR
        lines = [line for line in log.read_text().splitlines() if MARK in line]
        assert len(lines) == 1 and re.search(r"\[slow rank\] rank 1 on \S+: compute [\d.]+ s/step, ", lines[0]), lines
    finally:
        kill_tree(job)


# a job that runs until the test stops it: small steps, logged often, no checkpoints
SLOW_JOB = ["--data", "synthetic", "--model", "resnet_tiny", "--image-size", "32", "--batch-size", "8"]
SLOW_JOB += ["--steps", "100000", "--log-every", "5", "--warmup-epochs", "0", "--timing-warmup-steps", "5"]


def _named(report: Path) -> list[dict] | None:
    try:
        return json.loads(report.read_text())["slow"] or None
    except (OSError, ValueError):
        return None
