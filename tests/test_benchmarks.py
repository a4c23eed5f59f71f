"""The training-step benchmark runs end to end on a tiny model and reports what it measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_train_step_benchmark_interleaved_default_row(tmp_path):
    """One length, Neural Attention with the default and chunked paths, times interleaved: the table has a row
    per configuration with ratios to the unpatched step, and the default row says which path it took."""
    command = [
        sys.executable, str(ROOT / "benchmarks" / "train_step.py"),
        "--seq", "40", "--layers", "1", "--width", "32", "--heads", "2", "--steps", "2",
        "--scorers", "neural", "--impls", "default", "chunked", "--interleave", "--output_dir", str(tmp_path),
    ]  # fmt: skip
    finished = subprocess.run(command, capture_output=True, text=True, check=False, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    results = json.loads((tmp_path / "train_step.json").read_text())
    rows = results["results"] if isinstance(results, dict) else results
    assert {(row["scorer"], row["impl"]) for row in rows} == {
        ("none", "sdpa"),
        ("neural", "default"),
        ("neural", "chunked"),
    }
    assert all(row["timed"] == "interleaved" and row["time_s"] > 0 and row["peak_bytes"] > 0 for row in rows)
    table = (tmp_path / "train_step.md").read_text()
    assert "timed interleaved" in table
    # 1 x 2 heads x 40 x 40 x h=4 scores: well under the threshold, so the default materialises them.
    assert "| 40 | neural | default -> reference |" in table
    assert "| 40 | none | sdpa |" in table and "| 1.00 |" in table
