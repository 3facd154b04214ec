"""The release plugin (tests/support/fixtures/release.py): a heavy session fixture stops right after its
last selected user, before the next test, its dependents first; one fixture not listed stays up until
the session ends; one obtained later by a test the plugin could not see is started again."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

CONFTEST = """
import pytest

pytest_plugins = ["tests.support.fixtures.release"]


def event(what):
    with open("events.txt", "a") as out:
        out.write(what + "\\n")


@pytest.fixture(scope="session")
def kube_node():
    event("node up")
    yield
    event("node down")


@pytest.fixture(scope="session")
def agent_sandbox(kube_node):
    event("controller up")
    yield
    event("controller down")


@pytest.fixture(scope="session")
def kafka_broker():  # not released early
    event("broker up")
    yield
    event("broker down")


@pytest.fixture(scope="session")
def kafka_cluster():
    event("cluster up")
    yield
    event("cluster down")


@pytest.fixture
def note(request):
    event("run " + request.node.name)
"""


def _events(pytester: pytest.Pytester, tests: str, passed: int, *args: str) -> list[str]:
    """What the fixtures and tests did, in order, the session's end included."""
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_a=tests)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:asyncio", *args)
    result.assert_outcomes(passed=passed)
    return (pytester.path / "events.txt").read_text().splitlines()


def test_a_fixture_stops_after_its_last_user_dependents_first(pytester: pytest.Pytester) -> None:
    tests = """
def test_1(note, agent_sandbox, kafka_broker): pass
def test_2(note, kube_node): pass
def test_3(note, kafka_broker): pass
"""
    assert _events(pytester, tests, 3) == [
        "node up",
        "controller up",
        "broker up",
        "run test_1",
        "controller down",  # agent_sandbox's last user: test_1
        "run test_2",
        "node down",  # kube_node's: test_2
        "run test_3",
        "broker down",  # not released: at the session's end
    ]


def test_a_deselected_user_holds_nothing_and_an_unseen_late_user_starts_it_again(
    pytester: pytest.Pytester,
) -> None:
    tests = """
def test_1(note, kube_node): pass
def test_2(note): pass
def test_3(note, request): request.getfixturevalue("agent_sandbox")
def test_4(note, kube_node): pass
"""
    assert _events(pytester, tests, 3, "-k", "not test_4") == [
        "node up",
        "run test_1",
        "node down",  # test_4 deselected: test_1 was the last user
        "run test_2",
        "run test_3",
        "node up",  # getfixturevalue: not seen by the plugin, started again
        "controller up",
        "controller down",  # at the session's end
        "node down",
    ]


def test_the_clusters_users_run_one_after_another_from_the_first(pytester: pytest.Pytester) -> None:
    tests = """
def test_1(note): pass
def test_2(note, kafka_cluster): pass
def test_3(note): pass
def test_4(note, kafka_cluster): pass
def test_5(note): pass
def test_6(note, kafka_cluster): pass
"""
    assert _events(pytester, tests, 5, "-k", "not test_6") == [
        "run test_1",
        "cluster up",
        "run test_2",
        "run test_4",  # moved up behind test_2
        "cluster down",  # test_6 deselected: test_4 was the last user
        "run test_3",
        "run test_5",
    ]
