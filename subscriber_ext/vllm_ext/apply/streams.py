"""The one stream discipline between preparing weights off the step path and the commit.

Why: on a GPU the preparer thread and the step loop share the device. Without a
rule, the thread builds on device 0's legacy stream whatever the rank's device
(a new thread starts on device 0), the commit may read a shadow before its
kernels ran, and a shadow freed after the commit may hand its memory to the next
preparation while the step stream's copy still reads it. The rule:

1. The preparer thread calls ``torch.cuda.set_device`` with the rank's device and
   builds every shadow on one side stream of that device (``building``), which
   first waits for the thread's current stream (the live tensors it snapshots).
2. When a version's shadows are done, an event is recorded on the side stream and
   the thread waits for it (``done``): the version is committable only once its
   bytes are final, and the staged host buffer its copies read may be reused as
   soon as the commit releases it.
3. The commit (step thread) makes the step stream wait on that event
   (``before_copy``), copies on the step stream, and ``record_stream``s every shadow
   tensor it read (``read_by_step``), so freeing the shadow later (on the preparer
   thread) cannot hand its memory to the side stream before those copies ran.

On the CPU every step is a no-op.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["PrepStream"]


class PrepStream:
    """The side stream of one rank's device (none on CPU) and the rule above."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._stream: Any = None

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> PrepStream:
        """The device the model's weights live on (the first non-meta parameter)."""
        for p in model.parameters():
            if p.device.type != "meta":
                return cls(p.device)
        return cls(torch.device("cpu"))

    @contextmanager
    def building(self) -> Iterator[None]:
        """Preparer thread: run the block on the side stream of the rank's device."""
        if not self.cuda:
            yield
            return
        torch.cuda.set_device(self.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            yield

    def done(self) -> Any:
        """Preparer thread: an event after everything built so far, already complete."""
        if not self.cuda or self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        event.synchronize()
        return event

    def before_copy(self, event: Any) -> None:
        """Step thread: the step stream waits for the preparation's event."""
        if self.cuda and event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def read_by_step(self, tensors: Iterable[torch.Tensor]) -> None:
        """Step thread: tensors the step stream read must outlive those reads."""
        if not self.cuda:
            return
        stream = torch.cuda.current_stream(self.device)
        for t in tensors:
            if t.is_cuda:
                t.record_stream(stream)
