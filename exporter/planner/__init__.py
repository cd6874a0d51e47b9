"""edgert.exporter.planner: the placement of stages on devices, as a pure function, and live re-planning.

Map of the package (docs/PLANNER.md):

- ``solver.py``     :func:`plan`: the fastest placement (bottleneck first, then latency); the entry point
- ``problem.py``    :class:`PlanProblem` (:class:`Unit`, :class:`DeviceCosts`): what the planner is given, checked
- ``costs.py``      the cost model of one stage or link (the reference)
- ``tables.py``     the same model as numpy tables over unit ranges
- ``threads.py``    how a direction's time scales with ORT threads; a device's cores split side by side
- ``dp.py``         :class:`OrderDP`: the exact dynamic programme for one device order
- ``bounds.py``     lower bounds that prune the order search
- ``search.py``     every device order up to ``EXACT_DEVICES``, beam and local search beyond
- ``placement.py``  :class:`Placement`, :class:`StagePlan`, :func:`evaluate`: the planner's answer, for any stages
- ``brute.py``      :func:`brute_force`: the exhaustive reference for tests
- ``profile_costs.py`` a device's per-unit costs from its profile: fixed cost per stage, thread scaling, weight halves
- ``replanner.py``  :class:`Replanner`: measured or predicted device costs -> the problem -> a better placement?

:func:`plan` and everything it calls touch no files (``replanner.py`` is the side that reads
``devices.json`` and the plan's source and writes re-cut plans); ``PlanError`` (exporter/errors.py) says why no
placement exists.
"""
