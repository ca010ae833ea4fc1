"""Peak memory per phase of a run, measured: what train/run/memory_plan.py's phase lines are
checked against (summary.json `memory.phases`).

A process's peak RSS (`VmHWM`) only grows, so one figure says nothing of which phase set
it. Linux resets it to the current RSS when "5" is written to /proc/self/clear_refs: each
phase starts from a reset and reads its own peak when it ends (a nested phase, such as an
evaluation inside training, is its own phase: the enclosing one resumes from a reset after
it). The run's overall peak is the largest of them. On CUDA the same is done with
`torch.cuda.reset_peak_memory_stats` / `max_memory_allocated`. Where neither file exists
(not Linux), every phase reads None and the overall peak is VmHWM's or None.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch


def process_memory(key: str = "VmRSS") -> int | None:
    """This process's resident memory in bytes (`VmRSS`; `VmHWM`: its peak so far), from
    /proc/self/status; None where there is none."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _glibc(name: str):
    """glibc's function `name`, or None where the C library is not glibc."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


MALLOC_TRIM, MALLOPT = _glibc("malloc_trim"), _glibc("mallopt")


def give_back_freed() -> None:
    """Return the heap pages freed tensors left to the OS (glibc's `malloc_trim`): glibc
    keeps them mapped for its next allocations, so without this a process's RSS stays at
    the largest of its past transients (a held-out pass's full-vocabulary rows, timing
    copies) and every later phase is measured, and held, on top of them."""
    if MALLOC_TRIM is not None:
        MALLOC_TRIM(0)


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
# What train.py and scripts/evaluate.py fix it at: tensors over 1 MiB mapped and unmapped on
# their own, so batches of other lengths do not fragment the heap step by step (docs/memory.md)
HEAP_MMAP_THRESHOLD = 1 << 20
DYNAMIC_MMAP_CEILING = 32 << 20  # the most glibc's dynamic threshold rises to (64-bit)


def set_mmap_threshold(nbytes: int) -> bool:
    """glibc: every allocation of at least `nbytes` mapped on its own and unmapped when freed
    (`mallopt(M_MMAP_THRESHOLD)`). glibc otherwise raises the threshold to the largest block
    freed so far, up to 32 MiB, and serves smaller ones from a heap that fragments. False
    where there is no glibc."""
    return MALLOPT is not None and bool(MALLOPT(M_MMAP_THRESHOLD, int(nbytes)))


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS; False where the kernel cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


class PhaseMemory:
    """`with memory.phase("training"): ...` records that phase's peak RSS (and CUDA
    allocation); phases may nest and repeat (a repeated phase keeps its largest peak).
    What runs outside every phase is `outside` (the start-up: interpreter, target load).
    The newest tracker is `PhaseMemory.current`: code far from the loop (an evaluation's
    steps) marks its phases with `phase(name)`, a no-op where no run tracks."""

    current: PhaseMemory | None = None

    def __init__(self, device: torch.device, outside: str = "start-up") -> None:
        self.cuda = device if device.type == "cuda" else None
        self.rss: dict[str, int | None] = {}
        self.starts: dict[str, int | None] = {}  # RSS when the phase's largest peak began
        self.cuda_peak: dict[str, int] = {}
        self.stack = [outside]
        # RSS at each open phase's (re)start; None: the start-up's, from the process's start
        self.opened: list[int | None] = [None]
        self.resets = True  # until the kernel refuses one
        PhaseMemory.current = self

    def close_current(self) -> None:
        """Fold the peak since the last reset into the phase on top, give back what it freed
        (`give_back_freed`), then reset: the next phase starts from what is still held."""
        name = self.stack[-1]
        peak = process_memory("VmHWM")
        if peak is not None and peak >= (self.rss.get(name) or 0):
            self.rss[name], self.starts[name] = peak, self.opened[-1]
        gc.collect()  # the phase's reference cycles (a compile's graphs, copies' modules)
        give_back_freed()
        if self.cuda is not None:
            allocated = torch.cuda.max_memory_allocated(self.cuda)
            self.cuda_peak[name] = max(self.cuda_peak.get(name, 0), allocated)
            torch.cuda.reset_peak_memory_stats(self.cuda)
        self.resets = self.resets and reset_peak_rss()
        self.opened[-1] = process_memory()  # the phase goes on (or the next starts) from here

    def begin(self, name: str) -> None:
        self.close_current()
        self.stack.append(name)
        self.opened.append(self.opened[-1])

    def end(self) -> None:
        self.close_current()
        self.stack.pop()
        self.opened.pop()
        self.opened[-1] = process_memory()  # the enclosing phase resumes from here

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.begin(name)
        try:
            yield
        finally:
            self.end()

    def record(self) -> dict:
        """{"peak_rss_bytes": the run's peak so far, "phases": {name: {"peak_rss_bytes",
        "start_rss_bytes", "peak_cuda_allocated_bytes"}}}: start_rss_bytes is what the process
        held when the phase's largest peak began (its peak less it: what the phase itself
        added); without resets (not Linux) the phases after the first hold the run's peak
        so far, not their own, and are left out."""
        self.close_current()
        known = [b for b in self.rss.values() if b is not None]
        phases = {
            name: {
                "peak_rss_bytes": peak,
                "start_rss_bytes": self.starts.get(name),
                "peak_cuda_allocated_bytes": self.cuda_peak.get(name),
            }
            for name, peak in self.rss.items()
        }
        return {
            "peak_rss_bytes": max(known) if known else process_memory("VmHWM"),
            "peak_cuda_allocated_bytes": max(self.cuda_peak.values(), default=None),
            "phases": phases if self.resets else {},
        }


def phase(name: str) -> AbstractContextManager:
    """`PhaseMemory.current.phase(name)`, or nothing where no run tracks its memory."""
    memory = PhaseMemory.current
    return memory.phase(name) if memory is not None else nullcontext()
