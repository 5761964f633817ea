"""A backend's runtime requirements, checked against what is installed, by package metadata alone."""

from __future__ import annotations

import importlib.metadata

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aitune.registry import _fits, missing_requirements

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


RELEASE = st.lists(st.integers(0, 12), min_size=1, max_size=4).map(lambda parts: ".".join(map(str, parts)))


@given(
    clauses=st.lists(st.tuples(st.sampled_from([">=", "<=", "==", "!=", ">", "<"]), RELEASE), min_size=1, max_size=3),
    found=RELEASE,
    local=st.sampled_from(["", "+cpu", "+cu126.post"]),
)
def test_plain_releases_are_judged_as_packaging_judges_them(clauses, found, local):
    """Plain release clauses are checked without importing ``packaging`` (a load's cold start), with
    the same answer: zeros padded, an installed local label ignored."""
    from packaging.specifiers import SpecifierSet

    texts = tuple(f"{op}{version}" for op, version in clauses)
    installed = found + local
    assert _fits(texts, installed) == SpecifierSet(",".join(texts)).contains(installed, prereleases=True)


@pytest.mark.parametrize("installed", ["1.18.0rc1", "1.18.0.post1", "1.18.0.dev3", "2!1.0"])
def test_an_installed_pre_post_or_dev_release_is_left_to_packaging(installed):
    from packaging.specifiers import SpecifierSet

    for clauses in [(">=1.18",), ("<1.18",), ("==1.18",), (">=1.17", "<2")]:
        assert _fits(clauses, installed) == SpecifierSet(",".join(clauses)).contains(installed, prereleases=True)
