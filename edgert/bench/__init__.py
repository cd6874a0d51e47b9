"""edgert.bench: the benchmarks behind ``edgert bench <name>`` (edgert/cli/bench.py), beside the runtime.

The ``edgert bench`` commands and the tests import this package; the worker, the contract
and the wire never do.

Map of the package:

- ``harness.py``    what every benchmark shares: config options (:func:`option`), the result
  ``{"rows", "ratios"}``, same-run :func:`ratio`, :class:`Target`, fixed-width tables
- ``runs.py``       training runs as the benchmarks start them (loopback coordinator), :func:`steady_rate`
- ``transport.py``  ``edgert bench transport``: raw TCP vs coap+tcp vs coap (UDP), large-message strategies
- ``state.py``      ``edgert bench state``: a 400 MB stage state in pieces over coap+tcp (push, pull) vs raw TCP
- ``codecs.py``     the codec measurements: :func:`measure` (one codec, one tensor), sample tensors, codec rows
- ``recovery.py``   ``edgert bench recovery``: a SIGKILL mid-step, recovery vs restart, replication's cost
- ``faults.py``     fault injection shared with the tests: kill workers mid-step, tail ``metrics.jsonl``
- ``pipeline.py``   ``edgert bench pipeline``: edgert's overhead over bare ORT, 1F1B's pipeline efficiency
- ``torch_peer.py`` the torch.distributed.pipelining peer of ``edgert bench pipeline`` (where torch is installed)
- ``hop.py``        an idle hop (compute thread -> CoAP -> the peer's compute thread) and its raw TCP floor
- ``trace_hops.py`` the hops a training run met, from its ``trace.json`` (a late input's time in transit)
- ``calls.py``      a stage call's own cost: the runtime's forward/backward vs bare ``InferenceSession.run``
- ``hetero.py``     ``edgert bench hetero``: planned vs equal cuts vs the ideal on unequal devices, re-planning
- ``elastic.py``    ``edgert bench elastic``: a device that joins mid-run, steps until it computes
- ``groups.py``     ``edgert bench groups``: hybrid placements vs the best pipeline, speed-weighted vs equal shares
- ``gradients.py``  ``edgert bench gradients``: edgert's gradient graphs vs the training build's (or other plans'),
  stage by stage
"""
