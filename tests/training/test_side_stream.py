"""The side-stream protocol of the GPU decode path, on a stand-in for ``torch.cuda`` that records calls.

What a GPU run shows only as NaN losses now and then is checked here call by call: each batch is
made while a side stream is current, an event is recorded on that stream after its work, the
training stream waits for that event and ``record_stream`` covers the batch's tensors before the
batch is used, the host waits for a stream's previous batch before giving it the next one, inputs
are held until then, and batch N+1 is made before batch N is used.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tests.training.test_gpu_decode import pillow_jpeg_decoder
from training.data import imagenet as data
from training.data.gpu_decode import DeviceBatcher
from training.data.side_stream import HostStreams, SideStream, SideStreamBatches, Staged

TRAINING = "training"


class RecordingStreams:
    """A ``StreamApi`` that logs every call, with the stream current at the time where it matters."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.current = TRAINING
        self.sides = [SideStream(f"side{n}") for n in range(2)]
        self._events = 0

    def side_streams(self) -> list[SideStream]:
        return self.sides

    def current_stream(self) -> str:
        return self.current

    @contextlib.contextmanager
    def use(self, stream: str) -> Iterator[None]:
        outer, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = outer

    def new_event(self) -> RecordingEvent:
        self._events += 1
        return RecordingEvent(self.log, f"event{self._events - 1}")

    def wait_event(self, stream: str, event: RecordingEvent) -> None:
        self.log.append(("stream waits", stream, event.name))

    def record_stream(self, tensor: torch.Tensor, stream: str) -> None:
        self.log.append(("record_stream", int(tensor.flatten()[0]), stream))


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
    for images, labels, _ in staged_batches(api, [0, 1, 2]):
        api.log.append(("used", int(images[0]), api.current))
        del images, labels
    hand_over = [
        lambda n: ("stream waits", TRAINING, f"event{n}"),
        lambda n: ("record_stream", n, TRAINING),
        lambda n: ("record_stream", 100 + n, TRAINING),
        lambda n: ("used", n, TRAINING),
    ]

    def handed(n: int) -> list[tuple[Any, ...]]:
        return [step(n) for step in hand_over]

    assert api.log == [
        ("make", 0, "side0"),
        ("record", "event0", "side0"),
        ("make", 1, "side1"),  # batch 1 is queued before batch 0 is used: the prefetch
        ("record", "event1", "side1"),
        *handed(0),
        ("host waits", "event0"),  # side0 idle before nvJPEG writes into its pool again
        ("inputs released", 0),
        ("make", 2, "side0"),
        ("record", "event2", "side0"),
        *handed(1),
        *handed(2),
        ("host waits", "event2"),  # at the end, every stream's last inputs wait for its work
        ("inputs released", 2),
        ("host waits", "event1"),
        ("inputs released", 1),
    ]


def test_a_consumer_that_stops_early_still_waits_before_the_inputs_go() -> None:
    api = RecordingStreams()
    batches = staged_batches(api, [0, 1, 2, 3])
    next(batches)
    batches.close()  # as when training stops on an error
    assert api.log[-4:] == [
        ("host waits", "event0"),
        ("inputs released", 0),
        ("host waits", "event1"),
        ("inputs released", 1),
    ]
    assert ("make", 2, "side0") not in api.log


def test_a_second_loader_waits_for_the_batch_the_first_left_queued() -> None:
    """Evaluation runs between training steps, while training's next batch is queued on a side stream."""
    api = RecordingStreams()
    training = staged_batches(api, [0, 1, 2])
    next(training)  # batch 1 is now queued on side1
    assert [int(images[0]) for images, _, _ in staged_batches(api, [10, 11])] == [10, 11]
    assert api.log.index(("host waits", "event1")) < api.log.index(("make", 11, "side1"))
    assert [int(images[0]) for images, _, _ in training] == [1, 2]


def test_the_decoder_runs_on_the_side_stream_and_its_files_outlive_the_wait(tmp_path: Path) -> None:
    """The real batch assembly with a recording stand-in for nvJPEG."""
    from bench.harness.jpegs import write_imagenet_tree

    write_imagenet_tree(tmp_path, images=4, classes=2)
    folder = data.scan_split(tmp_path, "train", 32, seed=0)
    assert folder is not None
    api = RecordingStreams()
    files_seen: list[weakref.ref[torch.Tensor]] = []

    def decode(files: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        api.log.append(("decode", len(files), api.current))
        files_seen.extend(weakref.ref(file) for file in files)
        return pillow_jpeg_decoder(files, device)

    samples = [[folder.encoded((i, 0)) for i in keys] for keys in ([0, 1], [2, 3])]
    batches = SideStreamBatches(DeviceBatcher(decode, folder, torch.device("cpu")), api)(samples)
    first = next(batches)
    assert first[0].shape == (2, 32, 32, 3)
    assert [entry for entry in api.log if entry[0] in ("decode", "record")] == [
        ("decode", 2, "side0"),
        ("record", "event0", "side0"),
        ("decode", 2, "side1"),
        ("record", "event1", "side1"),
    ]
    assert all(ref() is not None for ref in files_seen)  # no host wait yet: both batches' files are held
    assert [entry for entry in api.log if entry[0] == "record_stream"] == [
        ("record_stream", int(first[0][0].flatten()[0]), TRAINING),
        ("record_stream", int(first[1][0]), TRAINING),
    ]
    list(batches)
    assert all(ref() is None for ref in files_seen)


def test_without_streams_the_batches_are_the_made_ones() -> None:
    made = [Staged((torch.full((1,), n), torch.full((1,), n), n), []) for n in range(3)]
    batches = list(SideStreamBatches(lambda n: made[n], HostStreams())(range(3)))
    assert [skipped for _, _, skipped in batches] == [0, 1, 2]
    assert all(batch[0] is staged.batch[0] for batch, staged in zip(batches, made, strict=True))
