"""The training-step benchmark runs end to end on a tiny model and reports what it measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.spawns, pytest.mark.compiles]

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(script: str, *flags: str, tmp_path: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "benchmarks" / script), *flags, "--output_dir", str(tmp_path)]
    finished = subprocess.run(command, capture_output=True, text=True, check=False, timeout=timeout)
    assert finished.returncode == 0, finished.stderr[-3000:]
    return finished


def test_train_step_benchmark_interleaved_default_row(tmp_path):
    """One length, Neural Attention as patch_model gives it, with the config's attention dropout and without, times
    interleaved: the table has a row per configuration and dropout with ratios to the unpatched step, and the
    default row says which path it took."""
    flags = ["--seq", "40", "--layers", "1", "--width", "32", "--heads", "2", "--steps", "2", "--scorers", "neural"]
    run_benchmark("train_step.py", *flags, "--interleave", tmp_path=tmp_path)
    results = json.loads((tmp_path / "train_step_gpt2.json").read_text())["results"]
    assert {(row["dropout"], row["scorer"], row["impl"]) for row in results} == {
        (dropout, scorer, impl)
        for dropout in ("config", "zero")
        for scorer, impl in (("none", "sdpa"), ("neural", "default"))
    }
    # What was measured, not how fast: a timing is no pass condition (a loaded machine makes any of them odd).
    assert all(row["timed"] == "interleaved" and isinstance(row["time_s"], float) for row in results)
    assert all(row["peak_bytes"] > 0 for row in results)
    table = (tmp_path / "train_step_gpt2.md").read_text()
    assert "timed interleaved" in table and "GPT-2 from its default config" in table
    # 1 x 2 heads x 40 x 40 x h=4 scores: well under the threshold, so the default materialises them, with
    # dropout or without.
    assert "| 40 | config | neural | default -> reference |" in table
    assert "| 40 | zero | neural | default -> reference |" in table
    assert "| 40 | config | none | sdpa |" in table and "| 1.00 |" in table


# The padded batches are timed in the interleaved process alone (--quick): the processes per configuration, which
# measure memory, build their batches the same way and are run by the test above.
def test_train_step_benchmark_on_a_padded_encoder_batch(tmp_path):
    flags = ["--family", "bert", "--batch", "2", "--padded", "--seq", "24", "--layers", "1", "--width", "32"]
    flags += ["--heads", "2", "--steps", "1", "--scorers", "qana", "--dropouts", "zero", "--quick"]
    run_benchmark("train_step.py", *flags, tmp_path=tmp_path)
    table = (tmp_path / "train_step_bert.md").read_text()
    assert "BERT (sequence classification)" in table and "rows 2 and on padded" in table
    assert "| 24 | zero | qana | default -> reference |" in table


def test_inference_benchmark_reports_prefill_and_decode_eager_and_compiled(tmp_path):
    flags = ["--prompt", "16", "--decode_steps", "2", "--rounds", "1", "--layers", "1", "--scorers", "qana"]
    run_benchmark("inference.py", *flags, "--compiled", tmp_path=tmp_path)
    results = json.loads((tmp_path / "inference.json").read_text())["results"]["16"]
    assert set(results) == {"none", "qana", "none compiled", "qana compiled"}
    # Every row timed its 2 decode steps themselves: the compiled ones through generate's per-token stamps (3 tokens,
    # the first ending the prefill), not as a difference of two generate calls. No timing is a pass condition.
    for name, times in results.items():
        recorded = {"paths"} if name == "qana" else set()  # the path is recorded for the patched eager row
        assert set(times) == {"prefill_s", "decode_s", "decode_steps"} | recorded, times
        assert times["decode_steps"] == 2, times
        assert isinstance(times["prefill_s"], float) and isinstance(times["decode_s"], float)
    table = (tmp_path / "inference.md").read_text()
    assert "| 16 | none |" in table and "| 16 | qana |" in table and "µs |" in table
    # Each mode's ratios are to the unpatched model of that mode.
    assert "| 16 | none compiled |" in table and "torch.compile(fullgraph=True)" in table
    assert table.count("| 1.00 |") >= 4


def test_inference_benchmark_at_smollm_135m_shape_in_bf16(tmp_path):
    """The model's weights in bf16 (--dtype), Neural Attention with proj_dim 2: the files' names carry device and
    dtype, and the patched row says which path the rule picked for the prefill and for a decode step."""
    flags = ["--preset", "smollm-135m", "--layers", "1", "--prompt", "8", "--decode_steps", "1", "--rounds", "1"]
    flags += ["--dtype", "bf16", "--proj_dim", "2", "--device", "cpu"]
    run_benchmark("inference.py", *flags, "--scorers", "neural", tmp_path=tmp_path)
    results = json.loads((tmp_path / "inference_smollm-135m_cpu_bf16.json").read_text())
    assert results["setup"]["preset"] == "smollm-135m" and set(results["results"]["8"]) == {"none", "neural"}
    # 9 heads x 8 x 8 scores x h=4 is far under the threshold: the rule materialises them, prefill and decode.
    assert results["results"]["8"]["neural"]["paths"] == {"prefill": "reference", "decode": "reference"}
    table = (tmp_path / "inference_smollm-135m_cpu_bf16.md").read_text()
    assert "SmolLM-135M's shape: Llama 1 layers x 576 wide, 9 query heads on 3" in table
    assert "(Neural Attention with proj_dim=2), weights in bf16" in table
    assert "| reference / reference |" in table


def test_train_step_benchmark_on_a_left_padded_decoder_batch_over_an_eager_base(tmp_path):
    flags = ["--batch", "2", "--padded", "--padding_side", "left", "--base", "eager", "--seq", "24", "--layers", "1"]
    flags += ["--width", "32", "--steps", "1", "--dropouts", "config", "--scorers", "qana", "--quick"]
    run_benchmark("train_step.py", *flags, tmp_path=tmp_path)
    table = (tmp_path / "train_step_gpt2.md").read_text()
    assert "padded from the middle on the left" in table and "| none | eager |" in table


def test_train_step_benchmark_compiled_quick(tmp_path):
    """--compiled --quick: every model compiled with fullgraph=True (a graph break would fail the run), the step and
    the compile time of each configuration from the one interleaved process, with ratios to the unpatched model;
    no memory columns. The times' values are not checked."""
    flags = ["--compiled", "--quick", "--seq", "24", "--layers", "1", "--width", "32", "--heads", "2", "--steps", "1"]
    flags += ["--scorers", "qana", "--impls", "chunked", "--dropouts", "config"]
    run_benchmark("train_step.py", *flags, tmp_path=tmp_path, timeout=600)  # two compiles
    results = json.loads((tmp_path / "train_step_gpt2.json").read_text())["results"]
    assert [(row["scorer"], row["impl"], row["resolved_impl"]) for row in results] == [
        ("none", "sdpa", "sdpa"),
        ("qana", "chunked", "chunked"),
    ]
    assert all(row["timed"] == "interleaved" and "compile_s" in row and "peak_bytes" not in row for row in results)
    table = (tmp_path / "train_step_gpt2.md").read_text()
    assert "torch.compile(model, fullgraph=True)" in table
    assert "| n | dropout | scorer | impl | step ms | x unpatched | compile s | x unpatched |" in table
    assert "| 24 | config | none | sdpa |" in table and "| 24 | config | qana | chunked |" in table


def test_train_step_dry_run_of_the_llama_shape_and_gpt2s_real_vocabulary(tmp_path):
    """--family llama takes SmolLM-135M's shape (grouped heads, its vocabulary) unless told otherwise; --vocab reaches
    every child; a GPT-2 given a grouped-head preset is refused, naming the flags."""
    flags = ["--dry_run", "--device", "cuda", "--dtype", "bf16", "--seq", "1024", "--dropouts", "config", "--quick"]
    flags += ["--impls", "auto"]
    llama = run_benchmark("train_step.py", "--family", "llama", *flags, tmp_path=tmp_path).stdout
    shape = "--family=llama --batch=1 --layers=30 --width=576 --heads=9 --kv_heads=3 --vocab=49152"
    assert shape in llama and "--runs=none/sdpa,qana/auto,neural/auto" in llama
    gpt2 = run_benchmark("train_step.py", "--vocab", "50257", "--proj_dim", "2", *flags, tmp_path=tmp_path).stdout
    assert "--layers=12 --width=768 --heads=12 --kv_heads=12 --vocab=50257" in gpt2 and "--proj_dim=2" in gpt2
    command = [sys.executable, str(ROOT / "benchmarks" / "train_step.py"), "--preset", "smollm-135m", *flags]
    refused = subprocess.run(command, capture_output=True, text=True, check=False, timeout=60)
    assert refused.returncode == 2 and "--family gpt2 has no grouped-query attention" in refused.stderr


def test_gpu_script_at_cpu_sizes_records_every_step(tmp_path):
    """benchmarks/gpu_issue48.sh with GPU_CHECK_DEVICE=cpu (tiny sizes), two of its steps: the Llama training step
    (grouped heads, bf16 autocast) runs; the targets check fails, since step b1's results are missing. summary.md
    has the versions and each step's status and tables, the run exits 1 for the failure, and $OUT gets the log and
    the results' archive."""
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "GPU_CHECK_DEVICE": "cpu", "GPU_CHECK_STEPS": "d targets", "PYTHON": sys.executable}
    env |= {"OUT": str(out), "GPU_CHECK_WORK": str(work)}
    command = ["bash", str(ROOT / "benchmarks" / "gpu_issue48.sh")]
    finished = subprocess.run(command, capture_output=True, text=True, check=False, timeout=600, env=env)
    summary = (out / "summary.md").read_text()
    assert finished.returncode == 1, summary
    assert "GPU_CHECK_DEVICE=cpu" in summary and "transformers 5." in summary
    assert "- d: ok" in summary and "- targets: failed (exit status 1)" in summary
    assert "Llama (causal LM) from its default config, 1 layers x 64 wide x 2 heads on 1 kv heads" in summary
    assert "| 64 | config | qana | auto -> reference |" in summary
    assert sorted(path.name for path in out.iterdir()) == ["gpu_issue48.log", "results.tar.gz", "summary.md"]
    with tarfile.open(out / "results.tar.gz") as archive:
        assert f"{work.name}/d_llama_64.json" in archive.getnames()


def test_train_step_interleaved_times_the_others_when_one_configuration_fails(tmp_path, monkeypatch):
    """A configuration that fails in the interleaved process (impl="triton" on a CPU, as a kernel that does not compile
    would on a GPU) becomes an error row that says why; the unpatched model and the other paths are timed still."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # with it the kernels would run on the CPU
    flags = ["--quick", "--seq", "24", "--layers", "1", "--width", "32", "--heads", "2", "--steps", "1"]
    flags += ["--scorers", "qana", "--impls", "triton", "chunked", "--dropouts", "config"]
    run_benchmark("train_step.py", *flags, tmp_path=tmp_path)
    rows = {row["impl"]: row for row in json.loads((tmp_path / "train_step_gpt2.json").read_text())["results"]}
    assert set(rows) == {"sdpa", "triton", "chunked"}
    assert "time_s" not in rows["triton"] and "triton" in rows["triton"]["error"], rows["triton"]
    assert all(isinstance(rows[impl]["time_s"], float) for impl in ("sdpa", "chunked")), rows
    table = (tmp_path / "train_step_gpt2.md").read_text()
    assert "| 24 | config | qana | triton | ValueError:" in table and "| 24 | config | qana | chunked |" in table
