"""The per-user admission limit alone: how many requests of one user may wait for decodes
at once, counted by a real Admission into real Metrics. No engine and no waiting: a
request past the share is refused at once, so a test of it never has to wait either.
The limit in the engine's opens is in tests/test_engine.py."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from decodefs.common.metrics import Metrics
from decodefs.daemon.admission import WAITING_PER_USER, Admission, UserBusy

USER, OTHER_USER = 60001, 60002


@given(per_user=st.integers(1, 64))
def test_a_user_may_have_its_share_of_requests_waiting_and_not_one_more(per_user: int) -> None:
    metrics = Metrics()
    admission = Admission(metrics, per_user)
    with contextlib.ExitStack() as waiting:
        for _ in range(per_user):
            waiting.enter_context(admission.waiting(USER))
        with pytest.raises(UserBusy):
            waiting.enter_context(admission.waiting(USER))
        assert metrics.errors["EAGAIN"] == 1
        waiting.enter_context(admission.waiting(OTHER_USER))  # nobody else is affected
        waiting.enter_context(admission.waiting(None))  # nor the daemon's own requests
    assert metrics.errors["EAGAIN"] == 1


def test_the_default_share_is_waiting_per_user() -> None:
    metrics = Metrics()
    admission = Admission(metrics)
    with contextlib.ExitStack() as waiting:
        for _ in range(WAITING_PER_USER):
            waiting.enter_context(admission.waiting(USER))
        with pytest.raises(UserBusy):
            waiting.enter_context(admission.waiting(USER))
    assert metrics.errors["EAGAIN"] == 1


def test_a_share_is_given_back_as_requests_stop_waiting() -> None:
    metrics = Metrics()
    admission = Admission(metrics, per_user=2)
    with admission.waiting(USER):
        with admission.waiting(USER), pytest.raises(UserBusy), admission.waiting(USER):
            pass
        with admission.waiting(USER):  # the second's place, free again
            pass
    with contextlib.ExitStack() as waiting:  # all gone: the whole share again
        waiting.enter_context(admission.waiting(USER))
        waiting.enter_context(admission.waiting(USER))
    with admission.waiting(USER):  # a request that failed still leaves its place
        with pytest.raises(ValueError), admission.waiting(USER):
            raise ValueError("the decode failed")
        with admission.waiting(USER):
            pass
    assert metrics.errors["EAGAIN"] == 1


def test_the_daemons_own_requests_are_never_limited() -> None:
    metrics = Metrics()
    admission = Admission(metrics, per_user=1)
    with contextlib.ExitStack() as waiting:
        for _ in range(10):
            waiting.enter_context(admission.waiting(None))
        waiting.enter_context(admission.waiting(USER))
    assert metrics.errors["EAGAIN"] == 0
