"""Engine adapters: one contract (``base``: a model loaded once, a session per configuration), built-ins
registered by name (``registry``): ``torch``, ``mlx``, ``llamacpp``, ``http`` with its server ``dialects``
and ``telemetry``; plugins by import path. The prefill plan (``plan``) and planted faults (``faults``)
are session options.

Imports: gatekeeper (the version), errors, identity, evidence, workspace, cache, setup.
"""
