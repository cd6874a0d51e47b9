"""edgert.worker: ``edgert worker``, what runs on a board (never imports exporter, coordinator, onnx).

Map of the package (resources: docs/PROTOCOL.md §9; threads and schedules: docs/RUNTIME.md):

- ``worker.py``         :class:`Worker`, :class:`WorkerConfig`: serves, installs a stage (/stage), takes
  the coordinator's commands (/run, /stop, /health), wires the parts below
- ``current_stage.py``  :class:`CurrentStage`: the stage installed, the segments announced, the health;
  what the parts share
- ``inputs.py``         :class:`StageInputs`: the inbox and /batch, /act, /grad, /groupgrad, checked before it
  sees them
- ``stage_weights.py``  :class:`StageWeights`: the stage's state by name (/weights), copies sent to and
  kept for peers (/replica), state taken over from others (/migrate)
- ``measurement.py``    :class:`Measurement`: /profile (a stage timed here), /probe and /echo (links)
- ``compute_thread.py`` :class:`ComputeThread`: runs the queued windows, reports steps, sends tensors on
- ``executor.py``       :class:`StageExecutor`: one window of the schedule, action by action (in a group:
  its rows only)
- ``forward_lane.py``   :class:`ForwardLane`: a stage's forwards on a thread of their own, beside its
  backwards (``--side-by-side``)
- ``group_exchange.py`` :class:`GroupExchange`: a group's gradients (and running statistics) combined before
  every optimizer step (/groupgrad)
- ``joining.py``        :class:`Joining`: ``--join``, offering the worker to a coordinator with bounded backoff
  until it is accepted or refused
- ``gate.py``           :class:`StepGate`: holding the pipeline at a step boundary (re-planning)
- ``inbox.py``          :class:`Inbox`: tensors received, waited for by the compute thread, capped
- ``outbox.py``         :class:`Outbox`: sends in flight, not waited for; what their failures mean
- ``stage_timer.py``    :func:`measure_stage`, :func:`probe_link`: a stage's times and memory, a link's
- ``slowdown.py``       :class:`SlowdownSchedule`, :class:`SlowdownEmulator`: emulated device speed (``--slowdown``)
- ``readiness.py``      :func:`check_board`: is this board ready to be a worker (``edgert doctor``)
- ``machine.py``        :func:`usable_cores`, :func:`memory_bytes`: the cores (its CPU affinity) and memory this
  board reports
- ``errors.py``         the worker's errors: the inbox's (aborted, timed out, skipped, full) and ``Busy`` (4.09)
"""
