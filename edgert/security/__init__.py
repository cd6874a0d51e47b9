"""edgert.security: who may join the cluster and what a worker agrees to run (docs/SECURITY.md).

Map of the package:

- ``keystore.py``   :class:`Keystore`: the cluster's certificate authority on the host: enrolment, revocation,
  the signing key (``edgert keys``); :class:`HostSecurity`, what the host commands talk and sign with;
  :func:`local_cluster_keys`, a throw-away cluster (demo, tests, benchmarks)
- ``admission.py``  :class:`Admission`, :class:`StageSigning`: signed stage assignments and revocation lists,
  checked on the worker before a stage is loaded; :func:`vet_stage_files`: its files' hashes and graphs
- ``onnx_scan.py``  :func:`scan_model`: the operator domains and external data an ONNX file would make the
  runtime use, read from its protobuf bytes (no ``onnx`` on a board)
- ``errors.py``     :class:`GraphRefused`, :class:`AdmissionRefused`, :class:`KeystoreError`

A board imports ``admission.py``, ``onnx_scan.py`` and ``errors.py``; ``keystore.py`` is host-side.
"""
