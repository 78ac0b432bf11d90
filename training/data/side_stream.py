"""Batches made on CUDA side streams, on a thread of their own, ahead of the training stream that uses them.

The GPU JPEG path (training/data/gpu_decode.py) needs this to be correct, not just fast. nvJPEG's
hardware decoder writes its output when the host makes the call, whatever is still queued on
the stream it is given (meta-pytorch/torchcodec PR 1634 measures it: a ``cudaStreamWaitEvent``
does not order the write, only a host wait does), and torchvision allocates that output on the
caller's stream (pytorch/vision PR 9606). Decoding on the training stream therefore let nvJPEG
overwrite blocks that the caching allocator had just recycled from tensors whose readers were
still queued: NaN losses whenever the host ran ahead of the GPU. The protocol here:

1. Each batch is made on a side stream (three, taken in turn), so every block it allocates comes
   from that stream's pool: the caching allocator never hands a block of one stream to another.
2. Before a side stream is given its next batch, the host waits for the event recorded after
   its previous one, so that stream has nothing queued when the decoder writes. A block in its
   pool is then free for real: freed by work of its own that has finished, or held by
   ``record_stream`` (4.) until the training stream's use of it has finished. With three
   streams the wait is for the batch made three batches ago, whose decode is long done.
3. After the batch's work is queued, an event is recorded on its side stream; the training
   stream waits for that event (a device-side wait, no host sync) before the batch is used.
4. The batch's tensors get ``record_stream(training stream)``: when the training loop drops them,
   the allocator keeps their blocks until the training stream's queued reads are done.
5. The host inputs of a batch's device work stay referenced until its event is waited for.

The batches are made on a thread of their own (``BatchThread``), up to ``AHEAD`` batches before
the training loop asks for them: the host waits of 2., nvJPEG's own stream synchronisations and
the decode's kernel launches all happen on that thread, so the training thread never waits for
the decoder; it only queues a device-side wait (3.) before it uses a batch.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

Batch = tuple[torch.Tensor, torch.Tensor, int]  # images (uint8 NHWC), labels, images skipped
STREAMS = 3  # side streams taken in turn: the host's wait (2.) is then for a batch AHEAD + 1 steps old
AHEAD = 2  # batches made and waiting before the training loop asks for them


@dataclass
class Staged:
    """A batch whose device work is queued, and the host objects that work reads."""

    batch: Batch
    inputs: list[Any] = field(default_factory=list)


class Event(Protocol):
    def record(self, stream: Any) -> None: ...
    def synchronize(self) -> None: ...


@dataclass(eq=False)
class SideStream:
    """A side stream and what was last queued on it. One set per device serves every loader of the
    process: evaluation's loader, running while training's has a batch queued, must wait for that
    batch too (2.), and streams made per loader would each strand cached blocks in a pool of their own."""

    stream: Any
    last: tuple[Event, list[Any]] | None = None  # the newest batch's event, and the inputs its work reads
    # Held from the wait (2.) to the event (3.): two loaders' threads may take the same stream.
    lock: threading.Lock = field(default_factory=threading.Lock)

    def drain(self) -> None:
        """The host waits until nothing is queued here (2.), then lets the inputs go (5.)."""
        if self.last is not None:
            event, _inputs = self.last
            event.synchronize()
            self.last = None


class StreamApi(Protocol):
    """The part of ``torch.cuda`` the protocol uses; tests pass a recording stand-in."""

    def side_streams(self) -> list[SideStream]: ...
    def enter_thread(self) -> None: ...
    def current_stream(self) -> Any: ...
    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]: ...
    def new_event(self) -> Event: ...
    def wait_event(self, stream: Any, event: Event) -> None: ...
    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None: ...


class CudaStreams:
    """``StreamApi`` on a CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._side: list[SideStream] = []

    def side_streams(self) -> list[SideStream]:
        if not self._side:
            self._side = [SideStream(torch.cuda.Stream(self.device)) for _ in range(STREAMS)]
        return self._side

    def enter_thread(self) -> None:
        torch.cuda.set_device(self.device)  # a new thread's current device is the first GPU

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def use(self, stream: torch.cuda.Stream) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def wait_event(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def record_stream(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        tensor.record_stream(stream)


class HostStreams:
    """``StreamApi`` where there are no streams (the CPU): work is done when the call returns."""

    class _Done:
        def record(self, stream: Any) -> None:
            pass

        def synchronize(self) -> None:
            pass

    def side_streams(self) -> list[SideStream]:
        return [SideStream(None) for _ in range(STREAMS)]

    def enter_thread(self) -> None:
        pass

    def current_stream(self) -> None:
        return None

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def new_event(self) -> Event:
        return self._Done()

    def wait_event(self, stream: Any, event: Event) -> None:
        pass

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        pass


@functools.cache
def streams_for(device: torch.device) -> StreamApi:
    """The process's one ``StreamApi`` (and so one set of side streams) for ``device``."""
    return CudaStreams(device) if device.type == "cuda" else HostStreams()


class SideStreamBatches:
    """``make(item)`` for each item on a side stream, on a thread of its own, handed to the training
    stream in order."""

    def __init__(self, make: Callable[[Any], Staged], api: StreamApi) -> None:
        self.make = make
        self.api = api

    def __call__(self, items: Iterable[Any]) -> Iterator[Batch]:
        thread = BatchThread(self.make, self.api, iter(items))
        try:
            while (made := thread.next()) is not None:
                yield self._hand_over(*made)
        finally:
            thread.stop()

    def _hand_over(self, batch: Batch, event: Event) -> Batch:
        consumer = self.api.current_stream()
        self.api.wait_event(consumer, event)
        images, labels, _ = batch
        for tensor in (images, labels):
            self.api.record_stream(tensor, consumer)
        return batch


_END = object()  # the items ran out


class BatchThread:
    """Makes the batches of ``items`` ahead of the consumer, at most ``AHEAD`` waiting in a queue.

    The thread iterates ``items`` (a DataLoader's batches) itself and closes them when stopped; an
    exception it meets is raised again in the consumer, in order, after the batches made before it.
    """

    def __init__(self, make: Callable[[Any], Staged], api: StreamApi, items: Iterator[Any]) -> None:
        self.make, self.api, self.items = make, api, items
        self.sides = api.side_streams()  # made here, on the consumer's thread, once per device
        self.ready: queue.Queue[tuple[Batch, Event] | BaseException | object] = queue.Queue(maxsize=AHEAD)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="batch-maker", daemon=True)
        self.thread.start()

    def next(self) -> tuple[Batch, Event] | None:
        """The next batch and the event its device work ends with; None after the last."""
        made = self.ready.get()
        if made is _END:
            return None
        if isinstance(made, BaseException):
            raise made
        return made  # type: ignore[return-value]

    def stop(self) -> None:
        """End the thread; once this returns, no side stream has work queued and every input is free."""
        self.stopping.set()
        while self.thread.is_alive():
            with contextlib.suppress(queue.Empty):  # a thread blocked on a full queue goes on
                self.ready.get(timeout=0.05)
        self.thread.join()

    def _run(self) -> None:
        sides = self.sides
        try:
            self.api.enter_thread()
            for index, item in enumerate(self.items):
                if self.stopping.is_set():
                    break
                side = sides[index % STREAMS]
                with side.lock:
                    side.drain()
                    with self.api.use(side.stream):
                        staged = self.make(item)
                        event = self.api.new_event()
                        event.record(side.stream)
                    side.last = (event, staged.inputs)
                self._put((staged.batch, event))
                del staged, item  # each batch and its inputs go when their owners are done
            self._put(_END)
        except BaseException as exc:  # raised again in the consumer
            self._put(exc)
        finally:
            close = getattr(self.items, "close", None)
            if close is not None:  # a DataLoader's workers stop with its iterator
                close()
            for side in sides:  # inputs stay referenced until their device work is done
                with side.lock:
                    side.drain()

    def _put(self, made: object) -> None:
        """Queue ``made`` for the consumer, unless it stops first."""
        while not self.stopping.is_set():
            try:
                self.ready.put(made, timeout=0.05)
                return
            except queue.Full:
                continue
