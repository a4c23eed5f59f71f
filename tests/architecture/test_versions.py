"""The supported transformers range: one floor in pyproject.toml, the import check and CI's oldest-release run."""

import re
from pathlib import Path

import pytest
import transformers
from packaging.requirements import Requirement
from packaging.version import Version

from hf_neural_attn.compat.versions import MIN_TRANSFORMERS, check_transformers_version, transformers_at_least

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_floor_is_the_import_check_floor():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (requirement,) = [Requirement(d) for d in dependencies if Requirement(d).name == "transformers"]
    floors = [Version(s.version) for s in requirement.specifier if s.operator == ">="]
    assert floors == [Version(MIN_TRANSFORMERS)]


def test_ci_tests_the_floor_release():
    oldest = re.search(r"^TRANSFORMERS_OLDEST \?= (\S+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert Version(oldest.group(1)) == Version(MIN_TRANSFORMERS)


def test_installed_transformers_passes_the_check():
    assert transformers_at_least(MIN_TRANSFORMERS)
    check_transformers_version()
    check_transformers_version(transformers.__version__)


# As pip compares them: a dev build of the floor release comes before it.
@pytest.mark.parametrize("installed", ["4.57.6", "5.0.0", "5.15.1", f"{MIN_TRANSFORMERS}.0.dev0"])
def test_an_older_transformers_is_refused_naming_the_release_needed(installed):
    with pytest.raises(ImportError, match=rf"needs transformers>={re.escape(MIN_TRANSFORMERS)}, found {installed}"):
        check_transformers_version(installed)


@pytest.mark.parametrize("installed", [MIN_TRANSFORMERS, f"{MIN_TRANSFORMERS}.1", "5.23.0", "5.30.0.dev0"])
def test_the_floor_and_later_releases_pass(installed):
    assert transformers_at_least(MIN_TRANSFORMERS, installed)
    check_transformers_version(installed)
