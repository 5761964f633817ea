"""A backend's runtime requirements, checked against what is installed, by package metadata alone."""

from __future__ import annotations

import importlib.metadata

import pytest

from aitune.registry import missing_requirements

TORCH = importlib.metadata.version("torch")


@pytest.mark.parametrize("requirement", ["torch", "torch>=1.0", "torch >= 1.0 , != 0.5", "torch>=1,<999", "Torch>=1"])
def test_an_installed_distribution_that_fits_is_not_missing(requirement):
    assert missing_requirements([requirement]) is None


def test_a_version_outside_the_specifier_names_the_installed_one():
    assert missing_requirements(["torch>=999"]) == f"torch {TORCH} is installed but torch>=999 is required"


def test_a_distribution_not_installed_says_what_to_install():
    assert missing_requirements(["no-such-dist-aitune>=1"]) == (
        "no-such-dist-aitune is not installed (pip install 'no-such-dist-aitune>=1')"
    )


def test_extras_markers_and_urls_are_understood_as_pep_508_says():
    assert missing_requirements(["torch[cuda]>=1"]) is None
    assert missing_requirements(['no-such-dist-aitune>=1; python_version < "3"']) is None, "a marker that is false"
    assert "no-such-dist-aitune is not installed" in missing_requirements(["no-such-dist-aitune @ https://x/y.whl"])


@pytest.mark.parametrize("requirement", ["torch>>1", "torch>=", ">=1.0"])
def test_an_invalid_requirement_is_named(requirement):
    assert missing_requirements([requirement]).startswith(f"invalid requirement {requirement!r}")
