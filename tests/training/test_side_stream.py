"""The side-stream protocol of the GPU decode path, on a stand-in for ``torch.cuda`` that records calls.

What a GPU run shows only as NaN losses now and then is checked here call by call: each batch is
made on the batch thread while a side stream is current, an event is recorded on that stream after
its work, the training stream waits for that event and ``record_stream`` covers the batch's tensors
before the batch is used, the host waits for a stream's previous batch before giving it the next
one, inputs are held until then, and batches are made ahead of the consumer without it waiting.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.training.test_gpu_decode import pillow_jpeg_decoder
from training.data import imagenet as data
from training.data.gpu_decode import DeviceBatcher, collate_encoded
from training.data.side_stream import AHEAD, STREAMS, HostStreams, SideStream, SideStreamBatches, Staged

TRAINING = "training"


class RecordingStreams:
    """A ``StreamApi`` that logs every call, with the stream current on the calling thread where it matters."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.sides = [SideStream(f"side{n}") for n in range(STREAMS)]
        self.threads: set[str] = set()  # the threads batches were made on
        self._current = threading.local()
        self._events = 0

    @property
    def current(self) -> str:
        return getattr(self._current, "stream", TRAINING)

    def side_streams(self) -> list[SideStream]:
        return self.sides

    def enter_thread(self) -> None:
        self.threads.add(threading.current_thread().name)

    def current_stream(self) -> str:
        return self.current

    @contextlib.contextmanager
    def use(self, stream: str) -> Iterator[None]:
        outer, self._current.stream = self.current, stream
        try:
            yield
        finally:
            self._current.stream = outer

    def new_event(self) -> RecordingEvent:
        self._events += 1
        return RecordingEvent(self.log, f"event{self._events - 1}")

    def wait_event(self, stream: str, event: RecordingEvent) -> None:
        self.log.append(("stream waits", stream, event.name))

    def record_stream(self, tensor: torch.Tensor, stream: str) -> None:
        self.log.append(("record_stream", int(tensor.flatten()[0]), stream))

    def made(self, count: int, kind: str = "make", timeout: float = 10.0) -> None:
        """Wait until ``count`` entries of ``kind`` are logged (the batch thread runs on its own)."""
        deadline = time.monotonic() + timeout
        while sum(entry[0] == kind for entry in self.log) < count:
            assert time.monotonic() < deadline, self.log
            time.sleep(0.01)


class RecordingEvent:
    def __init__(self, log: list[tuple[Any, ...]], name: str) -> None:
        self.log = log
        self.name = name

    def record(self, stream: str) -> None:
        self.log.append(("record", self.name, stream))

    def synchronize(self) -> None:
        self.log.append(("host waits", self.name))


class HostInput:
    """Stands in for a file tensor that the device work reads."""


def staged_batches(api: RecordingStreams, items: list[int]) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
    def make(item: int) -> Staged:
        api.log.append(("make", item, api.current))
        held = HostInput()
        weakref.finalize(held, api.log.append, ("inputs released", item))
        images, labels = torch.full((1,), item), torch.full((1,), 100 + item)
        return Staged((images, labels, 0), [held])

    return SideStreamBatches(make, api)(items)


def test_each_batch_is_made_on_a_side_stream_and_handed_over_in_order() -> None:
    api = RecordingStreams()
    count = 7
    batches = staged_batches(api, list(range(count)))
    for n, (images, labels, _) in enumerate(batches):
        if n == 0:  # the batch thread makes batches ahead while the consumer holds the first
            api.made(1 + AHEAD)
        api.log.append(("used", int(images[0]), api.current))
        del images, labels
    log = api.log
    assert api.threads and threading.current_thread().name not in api.threads
    for n in range(count):
        side = f"side{n % STREAMS}"
        made = log.index(("make", n, side))  # made while its side stream was current on the batch thread
        assert log.index(("record", f"event{n}", side)) > made
        waited = log.index(("host waits", f"event{n}"))
        assert waited < log.index(("inputs released", n))  # inputs held until the work that reads them is done
        if n + STREAMS < count:  # a side stream is idle before nvJPEG writes into its pool again
            assert waited < log.index(("make", n + STREAMS, side))
    assert log.index(("make", AHEAD, f"side{AHEAD % STREAMS}")) < log.index(("used", 0, TRAINING))
    # On the consumer's thread: the training stream waits for each batch's event, then the batch is used.
    consumer = [entry for entry in log if entry[0] in ("stream waits", "record_stream", "used")]
    assert consumer == [
        entry
        for n in range(count)
        for entry in (
            ("stream waits", TRAINING, f"event{n}"),
            ("record_stream", n, TRAINING),
            ("record_stream", 100 + n, TRAINING),
            ("used", n, TRAINING),
        )
    ]


def test_a_consumer_that_stops_early_still_waits_before_the_inputs_go() -> None:
    api = RecordingStreams()
    batches = staged_batches(api, list(range(10)))
    next(batches)
    api.made(1 + AHEAD)
    batches.close()  # as when training stops on an error
    made = [entry[1] for entry in api.log if entry[0] == "make"]
    assert len(made) < 10  # the thread stopped making batches
    for n in made:
        assert api.log.index(("host waits", f"event{n}")) < api.log.index(("inputs released", n))
    assert all(side.last is None for side in api.sides)


def test_an_error_while_making_a_batch_reaches_the_consumer_after_the_batches_before_it() -> None:
    api = RecordingStreams()

    def make(item: int) -> Staged:
        if item == 2:
            raise ValueError("a worker's error")
        return Staged((torch.full((1,), item), torch.full((1,), item), 0), [])

    batches = SideStreamBatches(make, api)(range(5))
    assert [int(next(batches)[0][0]) for _ in range(2)] == [0, 1]
    with pytest.raises(ValueError, match="a worker's error"):
        next(batches)


def test_a_second_loader_waits_for_the_batch_the_first_left_queued() -> None:
    """Evaluation runs between training steps, while training's next batches are queued on side streams."""
    api = RecordingStreams()
    training = staged_batches(api, [0, 1, 2, 3, 4, 5])
    next(training)
    api.made(1 + AHEAD)  # batches 1 and 2 are now queued on side1 and side2
    assert [int(images[0]) for images, _, _ in staged_batches(api, [10, 11, 12])] == [10, 11, 12]
    for ours, theirs in ((10, 0), (11, 1), (12, 2)):  # each waited for what the other loader queued there
        side = f"side{ours % 10 % STREAMS}"
        assert api.log.index(("make", theirs, side)) < api.log.index(("make", ours, side))
        assert api.log.index(("host waits", f"event{theirs}")) < api.log.index(("make", ours, side))
    assert [int(images[0]) for images, _, _ in training] == [1, 2, 3, 4, 5]


def test_the_decoder_runs_on_the_side_stream_and_its_files_outlive_the_wait(tmp_path: Path) -> None:
    """The real batch assembly with a recording stand-in for nvJPEG."""
    from bench.harness.jpegs import write_imagenet_tree

    write_imagenet_tree(tmp_path, images=4, classes=2)
    folder = data.scan_split(tmp_path, "train", 32, seed=0)
    assert folder is not None
    api = RecordingStreams()
    files_seen: list[list[weakref.ref[torch.Tensor]]] = []  # per batch

    def decode(files: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        api.log.append(("decode", len(files), api.current))
        files_seen.append([weakref.ref(file) for file in files])
        return pillow_jpeg_decoder(files, device)

    count = STREAMS + 2
    samples = [collate_encoded([folder.encoded((i, epoch)) for i in (0, 1)]) for epoch in range(count)]
    batches = SideStreamBatches(DeviceBatcher(decode, folder, torch.device("cpu")), api)(samples)
    first = next(batches)
    made = 2 + AHEAD  # the one taken, those queued, and the one waiting to be queued
    api.made(made, kind="record")
    assert first[0].shape == (2, 32, 32, 3)
    assert [entry for entry in api.log if entry[0] in ("decode", "record")][: 2 * made] == [
        entry
        for n in range(made)
        for entry in (("decode", 2, f"side{n % STREAMS}"), ("record", f"event{n}", f"side{n % STREAMS}"))
    ]
    held = [all(ref() is not None for ref in batch) for batch in files_seen[:made]]
    assert held == [False, True, True, True]  # side0 was waited for before it took batch 3: its files went
    assert [entry for entry in api.log if entry[0] == "record_stream"] == [
        ("record_stream", int(first[0][0].flatten()[0]), TRAINING),
        ("record_stream", int(first[1][0]), TRAINING),
    ]
    assert len(list(batches)) == count - 1
    assert all(ref() is None for batch in files_seen for ref in batch)


def test_without_streams_the_batches_are_the_made_ones() -> None:
    made = [Staged((torch.full((1,), n), torch.full((1,), n), n), []) for n in range(3)]
    batches = list(SideStreamBatches(lambda n: made[n], HostStreams())(range(3)))
    assert [skipped for _, _, skipped in batches] == [0, 1, 2]
    assert all(batch[0] is staged.batch[0] for batch, staged in zip(batches, made, strict=True))
