"""The slim core install: ``import hf_neural_attn`` needs only torch, transformers, safetensors and
huggingface_hub, and each extra's missing package is named with a one-line install hint.

A package is made missing by hiding it from the import system's path finder (in a subprocess, so nothing leaks into
the test session): what a virtualenv without the extra looks like to the importing code.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# pyyaml is not among them: transformers and huggingface_hub need it themselves.
EXTRAS = [
    "accelerate",
    "datasets",
    "evaluate",
    "matplotlib",
    "peft",
    "lm_eval",
    "triton",
    "sentence_transformers",
    "deepspeed",
    "bitsandbytes",
    "torchao",
]


def run_without(blocked: list[str], code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter where the top-level packages ``blocked`` cannot be found (the path finder
    is wrapped to return nothing for them, as it does for a package that is not installed)."""
    script = textwrap.dedent(
        f"""\
        import sys, importlib.machinery
        BLOCKED = {blocked!r}
        class HidingPathFinder:
            @classmethod
            def find_spec(cls, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    return None
                return importlib.machinery.PathFinder.find_spec(name, path, target)
            @classmethod
            def find_distributions(cls, *args, **kwargs):  # importlib.metadata asks the path finder too
                return importlib.machinery.PathFinder.find_distributions(*args, **kwargs)
            @classmethod
            def invalidate_caches(cls):
                importlib.machinery.PathFinder.invalidate_caches()
        sys.meta_path[:] = [HidingPathFinder if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
        """
    )
    return subprocess.run(
        [sys.executable, "-c", script + textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.spawns
def test_the_library_imports_patches_and_saves_without_any_extra(tmp_path):
    result = run_without(
        EXTRAS,
        f"""
        import torch, hf_neural_attn
        from transformers import LlamaConfig, LlamaForCausalLM
        model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1))
        hf_neural_attn.patch_model(model, "qana", h=2)
        model.save_pretrained({str(tmp_path)!r})
        hf_neural_attn.from_pretrained({str(tmp_path)!r})
        print("OK", sorted(m for m in {EXTRAS!r} if m in sys.modules))
        """,
    )
    assert result.stdout.strip().endswith("OK []"), result.stderr[-2000:]


@pytest.mark.spawns
@pytest.mark.parametrize(
    ("blocked", "code", "hint"),
    [
        (
            ["matplotlib"],
            "from hf_neural_attn import plotting; plotting._pyplot()",
            "pip install 'hf-neural-attn[plots]'",
        ),
        (["accelerate"], "import recipes.finetune", "pip install 'hf-neural-attn[recipes]'"),
        (["datasets", "evaluate"], "import recipes", "The recipes need datasets, evaluate"),
        (
            ["lm_eval"],
            "from recipes.harness import import_harness; import_harness()",
            "pip install 'hf-neural-attn[recipes]'",
        ),
    ],
)
def test_a_missing_extra_names_what_to_install(blocked, code, hint):
    result = run_without(blocked, code)
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("ImportError") and hint in last_line, result.stderr[-2000:]
