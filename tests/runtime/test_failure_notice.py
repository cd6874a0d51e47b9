"""The coordinator's book of failed workers: each failure counts from when it was noticed."""

from types import SimpleNamespace

from edgert.coordinator.failures import FailureDetector


class Ledger:
    """The ledger as failure notice sees it: it only gets interrupted."""

    def __init__(self):
        self.interruptions = 0

    def interrupt(self):
        self.interruptions += 1


def test_a_failure_noticed_during_a_recovery_counts_from_its_own_notice():
    state = SimpleNamespace(known={"a": "w-a", "b": "w-b", "c": "w-c"})
    ledger = Ledger()
    failures = FailureDetector(state, client=None, ledger=ledger, log=None, step_timeout=120.0)
    failures.notice({"a"}, 10.0)
    first = failures.failure()
    assert (first.urls, first.noticed_at) == ({"a"}, 10.0)
    state.known.pop("a")  # the recovery from a's failure begins
    failures.notice({"b"}, 20.0)  # b dies meanwhile
    failures.notice({"a", "b"}, 25.0)  # noticed again: nothing new
    assert failures.failure().noticed_at == 10.0 and ledger.interruptions == 2
    failures.recovered({"a"})  # that recovery is done
    second = failures.failure()
    assert (second.urls, second.noticed_at) == ({"b"}, 20.0)  # not a's 10.0: its detection_s is its own
