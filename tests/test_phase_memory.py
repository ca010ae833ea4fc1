"""Peak RSS per phase (train/phase_memory.py): a phase's peak is its own, not an earlier one's."""

import sys

import pytest
import torch

from train.phase_memory import PhaseMemory, give_back_freed, process_memory, reset_peak_rss

MB = 2**20
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not reset_peak_rss(), reason="needs /proc clear_refs"
)


def touch(nbytes: int) -> None:
    """Allocate and write `nbytes` (every page resident), then free them."""
    block = torch.ones(nbytes // 4, dtype=torch.float32)
    del block


def test_each_phase_reads_its_own_peak_and_the_run_the_largest():
    # The floor is the process with its freed heap given back, as each phase starts: earlier
    # tests' freed pages (hundreds of MB after a long suite) would otherwise sit in the floor
    # and leave it when the first phase trims them.
    give_back_freed()
    reset_peak_rss()  # the test process's earlier peaks are not this run's
    floor = process_memory("VmRSS")
    memory = PhaseMemory(torch.device("cpu"))
    with memory.phase("big"):
        touch(400 * MB)
    with memory.phase("small"):
        touch(40 * MB)
        with memory.phase("nested"):
            touch(200 * MB)
    record = memory.record()
    peaks = {name: p["peak_rss_bytes"] for name, p in record["phases"].items()}
    assert peaks["big"] - floor > 380 * MB
    assert peaks["nested"] - floor > 180 * MB
    # the 400 MB of "big" and the 200 MB of "nested" are not "small"'s: it read its own peak
    assert peaks["small"] - floor < 120 * MB
    assert record["peak_rss_bytes"] == max(peaks.values()) == peaks["big"]


def test_a_phase_records_what_it_held_when_it_began():
    """start_rss_bytes: the RSS a phase's largest peak rose from, so peak - start is what the
    phase added (a phase begun with 300 MB held reads its own 100 MB above them)."""
    give_back_freed()
    reset_peak_rss()
    memory = PhaseMemory(torch.device("cpu"))
    held = torch.ones(300 * MB // 4)  # kept through the next phase
    with memory.phase("on top"):
        touch(100 * MB)
    del held
    with memory.phase("alone"):
        touch(100 * MB)
    phases = memory.record()["phases"]
    on_top, alone = phases["on top"], phases["alone"]
    assert 90 * MB < on_top["peak_rss_bytes"] - on_top["start_rss_bytes"] < 140 * MB
    assert 90 * MB < alone["peak_rss_bytes"] - alone["start_rss_bytes"] < 140 * MB
    assert on_top["start_rss_bytes"] - alone["start_rss_bytes"] > 280 * MB
