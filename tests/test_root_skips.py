"""The line a run not as root ends with: how many tests it skipped for needing root, and why."""

from __future__ import annotations

import pytest

from tests.conftest import RUN_AS_ROOT


def test_a_run_that_skips_root_only_tests_says_how_many_and_why(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeconftest("from tests.conftest import pytest_terminal_summary  # noqa: F401")
    # skipif(True) stands for a run not as root, whoever runs this test.
    pytester.makepyfile(
        """
        import pytest

        mounts = pytest.mark.skipif(True, reason="needs root: mounts a tmpfs")
        netns = pytest.mark.skipif(True, reason="needs root: network namespaces")

        @mounts
        def test_a(): pass

        @mounts
        def test_b(): pass

        @netns
        def test_c(): pass

        @pytest.mark.skip(reason="not written yet")
        def test_d(): pass

        def test_e(): pass
        """
    )
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=1, skipped=4)
    result.stdout.fnmatch_lines(
        [
            "decodefs: 3 tests skipped for needing root (mounts a tmpfs (2); "
            f"network namespaces (1)); {RUN_AS_ROOT}"
        ]
    )


def test_a_run_that_skips_nothing_for_root_says_nothing(pytester: pytest.Pytester) -> None:
    pytester.makeconftest("from tests.conftest import pytest_terminal_summary  # noqa: F401")
    pytester.makepyfile("def test_e(): pass")
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=1)
    assert "skipped for needing root" not in result.stdout.str()
