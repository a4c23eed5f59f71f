"""The integrations room: what ``import hf_neural_attn`` changes in other libraries is its table, ``wrap_once`` replaces
each attribute once and puts it back, and the opt-out (``HF_NEURAL_ATTN_NO_INTEGRATIONS=1`` or row names, ``uninstall()``)
leaves transformers as it ships while ``patch_model``, ``save_pretrained`` and ``hf_neural_attn.from_pretrained`` work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers.models import logits, model_inputs, tiny_model
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.utils import hub

import hf_neural_attn
from hf_neural_attn import integrations
from hf_neural_attn.integrations import wrapping
from hf_neural_attn.integrations.installer import AT_IMPORT, PER_PATCHED_CONFIG_CLASS

ROOT = Path(__file__).resolve().parents[2]


def make_owner() -> type:
    """A stand-in for another library's class, fresh for each test."""

    class Owner:
        def method(self, x):
            return ("method", x)

        @classmethod
        def build(cls, x):
            return ("build", cls.__name__, x)

        @staticmethod
        def helper(x):
            return ("helper", x)

    return Owner


def tagging(original):
    def wrapper(*args, **kwargs):
        return ("wrapped", original(*args, **kwargs))

    return wrapper


@pytest.fixture
def restore_integrations():
    """Put the process's integrations back as ``import hf_neural_attn`` left them, whatever the test undid."""
    yield
    integrations.install()


def test_wrap_once_keeps_the_descriptor_kind_and_wraps_once(restore_integrations):
    Owner = make_owner()
    originals = dict(vars(Owner))
    assert wrapping.wrap_once(Owner, "method", tagging)
    assert wrapping.wrap_once(Owner, "build", tagging)
    assert wrapping.wrap_once(Owner, "helper", tagging)
    assert not wrapping.wrap_once(Owner, "method", tagging)  # a second install changes nothing
    assert Owner().method(1) == ("wrapped", ("method", 1))
    assert Owner.build(2) == ("wrapped", ("build", "Owner", 2))  # still a classmethod: cls is passed
    assert Owner.helper(3) == ("wrapped", ("helper", 3))
    assert isinstance(vars(Owner)["build"], classmethod) and isinstance(vars(Owner)["helper"], staticmethod)
    assert wrapping.is_wrapped(vars(Owner)["build"]) and not wrapping.is_wrapped(originals["build"])

    undone = integrations.uninstall()
    assert {name for name in undone if ".Owner." in name} == {
        f"{Owner.__module__}.{Owner.__qualname__}.{name}" for name in ("method", "build", "helper")
    }
    assert all(vars(Owner)[name] is originals[name] for name in ("method", "build", "helper"))


def test_undo_leaves_a_wrapper_someone_put_over_ours(restore_integrations):
    Owner = make_owner()
    wrapping.wrap_once(Owner, "method", tagging)

    def theirs(self, x):
        return "theirs"

    Owner.method = theirs
    integrations.uninstall()
    assert vars(Owner)["method"] is theirs


def test_wrap_once_names_what_is_missing():
    with pytest.raises(AttributeError, match="'Owner'.*'no_such_method'"):
        wrapping.wrap_once(make_owner(), "no_such_method", tagging)


def test_the_table_names_every_replacement_it_made():
    """Every attribute of another library the process replaced is named in a row of the table, so the table is the
    whole list of what the library changes."""
    import transformers.generation.continuous_batching.continuous_api  # noqa: F401 (its row installs on import)

    described = " ".join(f"{row.library} {row.changes}" for row in integrations.INTEGRATIONS)
    replaced = wrapping.replacements()
    assert {replacement.name for replacement in replaced} >= {
        "from_pretrained",
        "save_pretrained",
        "post_init",
        "create_and_tag_model_card",
        "switch_to_cb_friendly_attn",
    }
    assert [replacement.describe() for replacement in replaced if replacement.name not in described] == []
    for row in integrations.INTEGRATIONS:
        assert row.when in (AT_IMPORT, PER_PATCHED_CONFIG_CLASS) or "." in row.when, row


def test_uninstall_leaves_transformers_as_it_ships_and_the_explicit_api_working(tmp_path, restore_integrations):
    model = tiny_model("llama").eval()
    inputs = model_inputs("llama")
    undone = integrations.uninstall()
    assert "transformers.modeling_utils.PreTrainedModel.from_pretrained" in undone
    assert not integrations.installed()
    assert not wrapping.is_wrapped(vars(PreTrainedModel)["from_pretrained"])
    assert not wrapping.is_wrapped(hub.create_and_tag_model_card)
    assert "hf_neural_attn" not in CONFIG_MAPPING
    assert wrapping.registered_keys() == []

    hf_neural_attn.patch_model(model, "qana", h=4)
    assert type(model.config) not in AutoModelForCausalLM._model_mapping  # no Auto mapping for the new class
    expected = logits(model, inputs)
    model.save_pretrained(tmp_path)
    reloaded = hf_neural_attn.from_pretrained(tmp_path).eval()
    assert hf_neural_attn.is_patched(reloaded)
    torch.testing.assert_close(logits(reloaded, inputs), expected, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="trust_remote_code"):  # as without the library: the type is custom code
        AutoConfig.from_pretrained(tmp_path)

    integrations.install()  # everything back, the patched classes made meanwhile mapped too
    assert integrations.installed() and wrapping.is_wrapped(vars(PreTrainedModel)["from_pretrained"])
    auto_loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert hf_neural_attn.is_patched(auto_loaded)
    torch.testing.assert_close(logits(auto_loaded, inputs), expected, atol=1e-6, rtol=0)


OPTED_OUT = textwrap.dedent(
    """
    import json, sys, tempfile
    import torch
    import hf_neural_attn
    import transformers as tf
    import transformers.modeling_utils
    import transformers.generation.continuous_batching.continuous_api as continuous_api
    from transformers import PreTrainedModel
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.utils import hub
    from hf_neural_attn import integrations
    from hf_neural_attn.integrations import wrapping

    torch.manual_seed(0)
    tokens = {"input_ids": torch.randint(0, 64, (2, 10))}
    models = {
        "llama": (tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)), tokens),
        "gpt2": (tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64)), tokens),
        "vit": (tf.ViTForImageClassification(tf.ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
                num_attention_heads=4, intermediate_size=64, num_labels=3)), {"pixel_values": torch.randn(2, 3, 16, 16)}),
    }
    results = {}
    for name, (model, inputs) in models.items():
        model.eval()
        before = model(**inputs)[0]
        base = tempfile.mkdtemp()
        model.save_pretrained(base)
        hf_neural_attn.patch_model(model, "qana", h=4)
        preserved = float((model(**inputs)[0] - before).abs().max())
        with torch.no_grad():  # trained scorers: the reloads below must bring their weights back
            for parameter in hf_neural_attn.scorer_parameters(model).values():
                parameter.add_(0.05 * torch.randn_like(parameter))
        after = model(**inputs)[0]
        full, adapter = tempfile.mkdtemp(), tempfile.mkdtemp()
        model.save_pretrained(full)
        hf_neural_attn.save_adapter(model, adapter, base_model_name_or_path=base)
        reloaded = {kind: hf_neural_attn.from_pretrained(folder).eval() for kind, folder in (("full", full), ("adapter", adapter))}
        results[name] = {
            "preserved": preserved,
            "moved": float((after - before).abs().max()) > 1e-4,
            **{kind: float((loaded(**inputs)[0] - after).abs().max()) for kind, loaded in reloaded.items()},
            "patched": all(hf_neural_attn.is_patched(loaded) for loaded in reloaded.values()),
        }
    import hf_neural_attn.families.standard  # the family probe's row waits for it
    from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    print(json.dumps({
        "required_in_force": [name in ALL_ATTENTION_FUNCTIONS for name in ("hf_neural_attn", "hf_neural_attn_probe")]
        + [name in ALL_PARALLEL_STYLES for name in ("hf_neural_attn_per_head", "hf_neural_attn_shared")],
        "installed": integrations.installed(),
        "replaced": [r.describe() for r in wrapping.replacements()],
        "from_pretrained_wrapped": wrapping.is_wrapped(vars(PreTrainedModel)["from_pretrained"]),
        "card_wrapped": wrapping.is_wrapped(hub.create_and_tag_model_card),
        "batching_wrapped": wrapping.is_wrapped(vars(continuous_api.ContinuousBatchingManager)["switch_to_cb_friendly_attn"]),
        "auto_config_knows": "hf_neural_attn" in CONFIG_MAPPING,
        "families": results,
    }))
    """
)


@pytest.mark.spawns
def test_the_environment_opt_out_installs_nothing_in_transformers():
    """With the variable set before the import, transformers is left as it was, and the explicit API works on Llama,
    GPT-2 and ViT: patch_model preserves the outputs (1e-5), and a full checkpoint and a scorer-only adapter of the
    trained model load back with hf_neural_attn.from_pretrained to its outputs (1e-6)."""
    environment = {**os.environ, integrations.OPT_OUT_VARIABLE: "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", OPTED_OUT], capture_output=True, text=True, env=environment, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {
        "required_in_force": [True, True, True, True],  # the attention function, the probe, the two styles
        "installed": False,
        "replaced": [],
        "from_pretrained_wrapped": False,
        "card_wrapped": False,
        "batching_wrapped": False,
        "auto_config_knows": False,
        "families": {
            family: {
                "preserved": pytest.approx(0.0, abs=1e-5),
                "moved": True,  # the scorers' new weights change the outputs: a reload that lost them would show
                "full": pytest.approx(0.0, abs=1e-6),
                "adapter": pytest.approx(0.0, abs=1e-6),
                "patched": True,
            }
            for family in ("llama", "gpt2", "vit")
        },
    }


@pytest.mark.parametrize("value, opted_out", [("1", True), ("true", True), ("0", False), ("", False), ("no", False)])
def test_the_opt_out_variable_reads_like_a_switch(monkeypatch, value, opted_out):
    from hf_neural_attn.integrations.installer import opted_out as reads_opted_out

    monkeypatch.setenv(integrations.OPT_OUT_VARIABLE, value)
    assert reads_opted_out() is opted_out


def test_the_opt_out_variable_may_name_rows():
    from hf_neural_attn.integrations.installer import optional_rows, rows_left_out

    assert rows_left_out("all") == optional_rows() >= {"push card", "continuous batching", "Auto classes"}
    assert rows_left_out(" Push Card ,continuous batching,") == {"push card", "continuous batching"}
    with pytest.raises(ValueError, match=r"names \['attention function'\].*required rows cannot be left out"):
        rows_left_out("attention function")
    with pytest.raises(ValueError, match=r"names \['push cards'\].*not optional rows.*'push card'"):
        rows_left_out("push cards")


LEFT_OUT = textwrap.dedent(
    """
    import json
    import hf_neural_attn
    import transformers.modeling_utils
    import transformers.generation.continuous_batching.continuous_api as continuous_api
    from transformers import PreTrainedModel
    from transformers.utils import hub
    from hf_neural_attn import integrations
    from hf_neural_attn.integrations import wrapping
    from hf_neural_attn.integrations import enabled_rows

    def state():
        return {
            "installed": integrations.installed(),
            "from_pretrained": wrapping.is_wrapped(vars(PreTrainedModel)["from_pretrained"]),
            "card": wrapping.is_wrapped(hub.create_and_tag_model_card),
            "batching": wrapping.is_wrapped(vars(continuous_api.ContinuousBatchingManager)["switch_to_cb_friendly_attn"]),
            "rows": enabled_rows(),
        }

    at_import = state()
    integrations.install()
    print(json.dumps({"at_import": at_import, "after_install": state()}))
    """
)


@pytest.mark.spawns
def test_the_environment_may_leave_out_single_rows():
    """``HF_NEURAL_ATTN_NO_INTEGRATIONS="push card, continuous batching"`` leaves those two rows out and installs the
    rest; ``install()`` then puts them in, for the modules already imported."""
    environment = {
        **os.environ,
        integrations.OPT_OUT_VARIABLE: "push card, continuous batching",
        "PYTHONPATH": str(ROOT),
    }
    result = subprocess.run(
        [sys.executable, "-c", LEFT_OUT], capture_output=True, text=True, env=environment, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    every_row = [row.name for row in integrations.INTEGRATIONS]
    assert report == {
        "at_import": {
            "installed": False,
            "from_pretrained": True,
            "card": False,
            "batching": False,
            "rows": [name for name in every_row if name not in ("push card", "continuous batching")],
        },
        "after_install": {
            "installed": True,
            "from_pretrained": True,
            "card": True,
            "batching": True,
            "rows": every_row,
        },
    }
