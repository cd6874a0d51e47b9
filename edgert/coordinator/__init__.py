"""edgert.coordinator: the central node (``edgert train``, ``edgert profile``); runs on the host.

Map of the package. The run loop and the parts it wires together (each owns its state and
serves the resources that touch it; what they share is a :class:`RunState`):

- ``coordinator.py``   :class:`TrainConfig`, :class:`Coordinator`: the run loop (connect, assign, train,
  evaluate, release) and ``POST /report``; ``train()``, ``resumed_config()``
- ``stage_groups.py``  :func:`place_workers`, :func:`member_rows`: stages held by groups (placement.json), each
  member's rows of a batch
- ``run_state.py``     :class:`RunState`: what the parts share (run id, placement, known workers), and who writes it
- ``segments.py``      :func:`next_segment`, :class:`SegmentRunner`: announce a segment (``/run``), feed its
  steps' data ahead, hold and truncate it for a re-plan
- ``failures.py``      :class:`FailureWatch`, :class:`FailureDetector`: noticing failed workers (health
  observation, overdue steps, failed sends) until they are recovered from
- ``recovery.py``      :class:`Recovery`: roll back to the newest snapshot on the survivors, resume a stopped
  run; ``PUT /replica`` and ``FETCH /weights``
- ``snapshots.py``     :class:`CentralCopies` and the search for the newest consistent snapshot and its holders
- ``replanning.py``    :class:`Replanning`: when the placement is checked, moving the cuts; ``POST /join``
- ``evaluation.py``    :class:`Evaluation` (epoch ends, ``checkpoints/latest``) and :class:`StateScorer` (the
  plan's stages chained on the test set)

Around the run:

- ``assignment.py``    sending stages to workers (``PUT /stage``) and migrating state when the cuts move
- ``ledger.py``        :class:`StepLedger`: the stages' step reports; a step is done when every stage reported
- ``inputs.py``        what the coordinator's resources let in: reports, copies and copy queries of this run
- ``data.py``          the training data for a plan and its seeded batches
- ``runlog.py``        the run folder: ``run.json``, ``metrics.jsonl``, ``trace.json``
- ``tracefile.py``     ``trace.json`` streamed as Chrome trace events
- ``run_summary.py``   :class:`RunSummary`: the end-of-run summary, read from the run folder
- ``profiling.py``     ``edgert profile``: every device measured on every unit of a model, and every link
- ``localcluster.py``  worker processes on this machine, for ``edgert demo``, the tests and the benchmarks
- ``errors.py``        the coordinator's errors: :class:`TrainingError`, :class:`WorkerFailure`, assignment, data
"""
