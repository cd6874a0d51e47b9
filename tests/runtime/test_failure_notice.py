"""The coordinator's book of failed workers: each failure counts from when it was noticed."""

from types import SimpleNamespace

from edgert.coordinator.recovery import RecoveryMixin


class Noticing(RecoveryMixin):
    """The coordinator's state that noticing failures reads and writes (the ledger only gets interrupted)."""

    def __init__(self):
        self.known = {"a": "w-a", "b": "w-b", "c": "w-c"}
        self._failed = {}
        self.interruptions = 0
        self.ledger = SimpleNamespace(interrupt=self._interrupt)

    def _interrupt(self):
        self.interruptions += 1


def test_a_failure_noticed_during_a_recovery_counts_from_its_own_notice():
    coordinator = Noticing()
    coordinator._on_worker_failure({"a"}, 10.0)
    first = coordinator._failure()
    assert (first.urls, first.noticed_at) == ({"a"}, 10.0)
    coordinator.known.pop("a")  # the recovery from a's failure begins
    coordinator._on_worker_failure({"b"}, 20.0)  # b dies meanwhile
    coordinator._on_worker_failure({"a", "b"}, 25.0)  # noticed again: nothing new
    assert coordinator._failure().noticed_at == 10.0 and coordinator.interruptions == 2
    coordinator._failed.pop("a")  # that recovery is done (_recover_once)
    second = coordinator._failure()
    assert (second.urls, second.noticed_at) == ({"b"}, 20.0)  # not a's 10.0: its detection_s is its own
