"""bench/copy_timeline.py: the per-layer intervals of a window prefill from a LLAMAPACK_COPY_TRACE file."""
from __future__ import annotations

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("copy_timeline", Path(__file__).parent.parent / "bench" / "copy_timeline.py")
copy_timeline = importlib.util.module_from_spec(spec)
spec.loader.exec_module(copy_timeline)


def trace_lines(pid: int, start_us: int, layers: int, launch: int, issue: int, sync: int, wait: int) -> list[str]:
    """A prefill as libllama traces it: op L ends, the GPU split's input copy, its launch, the CPU split's input
    copy (the callback issues layer L+1's copies), the GPU sync, op L+1 waits for its window."""
    lines, t = [], start_us
    for layer in range(layers):
        lines.append(f"{pid} {t} window_op {layer} 512 -")
        t += wait
        lines.append(f"{pid} {t} window_op_end {layer} {128 * (layer + 1)} -")
        t += 10
        lines.append(f"{pid} {t} copy_into_split -1 0 llamapack_slot_ids-{layer}-window")
        t += launch
        lines.append(f"{pid} {t} copy_into_split -1 1 ffn_moe_argsort-{layer + 1}")
        t += issue
        lines.append(f"{pid} {t} early_issued -1 128 -")
        t += sync
    return lines


def test_intervals_per_layer_and_prefills_split_at_the_first_layer(tmp_path):
    lines = trace_lines(7, 1000, 4, launch=5000, issue=800, sync=200, wait=6000)
    lines += trace_lines(7, 10_000_000, 4, launch=100, issue=900, sync=5000, wait=1000)
    lines.append("7 20000000 window_op 0 16 -")  # a small ubatch: not a window prefill of >= 512 tokens
    (tmp_path / "trace.txt").write_text("\n".join(lines) + "\n")
    events = copy_timeline.parse(str(tmp_path / "trace.txt"))
    runs = copy_timeline.prefills(events[7], 512)
    assert len(runs) == 2
    first, second = (copy_timeline.summary(copy_timeline.layer_intervals(run)) for run in runs)
    assert first["layers"] == 3 == second["layers"]  # layers 1..3: layer 0 has no op before it
    assert first["median"] == {"launch_ms": 5.0, "issue_ms": 0.8, "sync_ms": 0.2, "wait_ms": 6.0}
    assert second["median"] == {"launch_ms": 0.1, "issue_ms": 0.9, "sync_ms": 5.0, "wait_ms": 1.0}
    assert first["sum"]["wait_ms"] == 18.0


def test_an_op_without_copies_started_early_has_no_row(tmp_path):
    lines = ["1 0 window_op 0 512 -", "1 10 window_op_end 0 128 -", "1 20 copy_into_split -1 0 x",
             "1 30 copy_into_split -1 1 y", "1 40 window_op 1 512 -", "1 50 window_op_end 1 256 -"]
    (tmp_path / "t.txt").write_text("\n".join(lines) + "\n")
    run, = copy_timeline.prefills(copy_timeline.parse(str(tmp_path / "t.txt"))[1], 512)
    assert copy_timeline.layer_intervals(run) == []


def test_copies_started_at_the_gpu_input_count_their_issue_in_the_launch(tmp_path):
    lines = ["1 0 window_op 0 512 -", "1 100 window_op_end 0 128 -", "1 110 copy_into_split -1 0 ids",
             "1 910 early_issued -1 128 -", "1 1000 copy_into_split -1 1 argsort", "1 6000 window_op 1 512 -",
             "1 7000 window_op_end 1 256 -"]
    (tmp_path / "t.txt").write_text("\n".join(lines) + "\n")
    run, = copy_timeline.prefills(copy_timeline.parse(str(tmp_path / "t.txt"))[1], 512)
    row, = copy_timeline.layer_intervals(run)
    assert row == dict(layer=1, launch_ms=0.89, issue_ms=0.8, sync_ms=5.0, wait_ms=1.0)
