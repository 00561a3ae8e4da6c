"""A GPU's own allocation trace through the allocator model (``validation.allocator_trace``, the
check ``make validate-gpu`` runs): the trace's actions read as CUDA's caching allocator writes them
(``torch.cuda.memory._snapshot()["device_traces"]``), the GPU's own peaks from its segments, and the
replay of the same requests. The traces here are written by hand as the allocator acts on them
(``c10/cuda/CUDACachingAllocator.cpp``: a 2 MiB segment for small requests, a segment of the
request rounded to 2 MiB from 10 MiB on, pools per stream, a block reusable at its
``free_completed``); no GPU is needed to read one."""

import pytest

from validation.allocator_trace import (
    REPLAY_STREAMS,
    check_trace,
    load_trace,
    main,
    save_trace,
    trace_events,
    trace_peaks,
)
from validation.gpu import allocator_line

KiB, MiB = 1 << 10, 1 << 20
A, B = 7, 9  # two CUDA stream handles


def _entry(action: str, addr: int, size: int, stream: int = A) -> dict[str, int | str]:
    return {"action": action, "addr": addr, "size": size, "stream": stream}


def _two_streams_trace() -> list[dict[str, int | str]]:
    """Stream A: two 600 KiB tensors share one 2 MiB small segment; a 12 MiB tensor gets a 12 MiB
    segment, is freed, and an 11 MiB one reuses its block (the 1 MiB left is not split off). Stream
    B asks for 11 MiB too: A's free blocks are not B's, so a third segment."""
    return [
        _entry("segment_alloc", 0x1000_0000, 2 * MiB),
        _entry("alloc", 0x1000_0000, 600 * KiB),
        _entry("alloc", 0x1000_0000 + 600 * KiB, 600 * KiB),
        _entry("segment_alloc", 0x2000_0000, 12 * MiB),
        _entry("alloc", 0x2000_0000, 12 * MiB),
        _entry("free_requested", 0x2000_0000, 12 * MiB),
        _entry("free_completed", 0x2000_0000, 12 * MiB),
        _entry("alloc", 0x2000_0000, 12 * MiB),  # the 11 MiB request takes the whole block
        _entry("segment_alloc", 0x3000_0000, 12 * MiB, B),
        _entry("alloc", 0x3000_0000, 11 * MiB, B),
    ]


def test_the_trace_reads_as_allocs_and_completed_frees_each_cuda_stream_its_own() -> None:
    events = trace_events(_two_streams_trace())
    assert events == [
        ("alloc", 0x1000_0000, 600 * KiB, "compute"),
        ("alloc", 0x1000_0000 + 600 * KiB, 600 * KiB, "compute"),
        ("alloc", 0x2000_0000, 12 * MiB, "compute"),
        ("free", 0x2000_0000, 0, "compute"),
        ("alloc", 0x2000_0000, 12 * MiB, "compute"),
        ("alloc", 0x3000_0000, 11 * MiB, "all_gather"),
    ]
    assert trace_peaks(_two_streams_trace()) == {
        "reserved_bytes": 26 * MiB,
        "active_bytes": 1200 * KiB + 12 * MiB + 11 * MiB,
    }


def test_the_model_fed_the_gpus_sequence_reserves_its_segments() -> None:
    check = check_trace(_two_streams_trace(), capacity_bytes=80 << 30)
    assert check == {
        "entries": 10,
        "streams": 2,
        "gpu_reserved_bytes": 26 * MiB,
        "replayed_reserved_bytes": 26 * MiB,
        "gpu_active_bytes": 1200 * KiB + 23 * MiB,
        "replayed_active_bytes": 1200 * KiB + 23 * MiB,
    }


def test_a_block_another_stream_still_uses_is_reused_only_once_its_free_completes() -> None:
    """``record_stream``: the 20 MiB block is dropped (``free_requested``) but completes only after
    the next 20 MiB request, which therefore takes a second segment, in the GPU and in the replay."""
    trace = [
        _entry("segment_alloc", 0x1000_0000, 20 * MiB),
        _entry("alloc", 0x1000_0000, 20 * MiB),
        _entry("free_requested", 0x1000_0000, 20 * MiB),
        _entry("segment_alloc", 0x2000_0000, 20 * MiB),
        _entry("alloc", 0x2000_0000, 20 * MiB),
        _entry("free_completed", 0x1000_0000, 20 * MiB),
        _entry("alloc", 0x1000_0000, 20 * MiB),  # now the first block serves
    ]
    check = check_trace(trace, capacity_bytes=80 << 30)
    assert check["gpu_reserved_bytes"] == check["replayed_reserved_bytes"] == 40 * MiB
    # freed at free_requested instead, the second request would have reused the first block
    early = [e for e in trace[:-1] if e["action"] != "free_completed"]
    early = [dict(e, action="free_completed") if e["action"] == "free_requested" else e for e in early]
    assert check_trace(early, capacity_bytes=80 << 30)["replayed_reserved_bytes"] == 20 * MiB


def test_more_cuda_streams_than_the_replay_has_is_refused() -> None:
    trace = [_entry("alloc", i * MiB, MiB, stream=100 + i) for i in range(len(REPLAY_STREAMS) + 1)]
    with pytest.raises(ValueError, match="CUDA streams"):
        trace_events(trace)


def test_the_gpu_section_states_both_peaks() -> None:
    check = check_trace(_two_streams_trace(), capacity_bytes=80 << 30)
    line = allocator_line("llama-34m", check)
    assert line == (
        "llama-34m: the caching allocator's model fed this GPU's own allocation trace of the run "
        "(10 entries, 2 streams) reserves 0.025 GiB against the GPU's 0.025 GiB (+0.0%); its active "
        "peak 0.024 against 0.024 GiB."
    )


def test_a_saved_trace_reads_back_as_the_same_check(tmp_path, capsys) -> None:
    """The trace ``make validate-gpu-device`` brings home (``save_trace``) is read here without a
    GPU: the same entries, the device's memory and name, and the same check from the command."""
    entries = _two_streams_trace()
    path = tmp_path / "trace.json.gz"
    save_trace(path, entries, capacity_bytes=80 << 30, device="NVIDIA H100 80GB HBM3")
    loaded, capacity, device = load_trace(path)
    assert loaded == entries and capacity == 80 << 30 and device == "NVIDIA H100 80GB HBM3"
    assert main([str(path)]) == 0
    check = check_trace(entries, 80 << 30)
    printed = capsys.readouterr().out
    assert f"the GPU {check['gpu_reserved_bytes'] / 2**30:.3f} GiB" in printed
    assert f"its sequence {check['replayed_reserved_bytes'] / 2**30:.3f} GiB" in printed


def test_a_file_that_is_no_saved_trace_is_one_clear_error(tmp_path, capsys) -> None:
    path = tmp_path / "not-a-trace.json.gz"
    path.write_text("{}")
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("allocator_trace: error:") and str(path) in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
