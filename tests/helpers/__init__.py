"""Helpers shared by the tests, by subject; import from these modules, never from conftest.py or another test file.

* ``helpers.models``: tiny models built from configs (no downloads), FAMILY_CASES (every family the suite builds and
  the flags that pick each contract's families), their inputs, moving scorers off their init;
* ``helpers.scorers``: SCORER_CASES (every scorer case, run by tests/scorers/test_scorer_contracts.py) and
  FUSED_SCORERS;
* ``helpers.checkpoints``: CHECKPOINT_KINDS (full, adapter), saving either, reading and editing its patch record;
* ``helpers.references``: the float64 scorer geometry, literal RoPE, gradcheck, output and gradient comparisons;
* ``helpers.paths``: IMPLS and the compute paths; ``helpers.installed``: what the installed packages allow;
* ``helpers.processes``: process groups over gloo, free ports and servers' health.

The tables are described in docs/testing.md, "The tables".
"""

import os

# Nothing in the tests may reach the Hub; say so, so a stray lookup fails at once instead of waiting. Here, so that
# any helper module sets it before transformers or huggingface_hub is imported by it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
