"""A Hugging Face model from its ``config.json``, described for the simulator (torch side).

``transformers`` builds the real class on the meta device (exact parameters and shapes, the wrap
unit from ``_no_split_modules``); one forward and backward under ``FakeTensorMode`` at the
scenario's micro-batch, sequence length and dtype measures every op (FLOPs, bytes moved,
saved-activation bytes, transients, Python-level calls). The result is a versioned JSON model
description (``sim.workload.description``) that the torch-free simulator reads, cached on disk by
``sim.scenario.hf_model``. ``python -m hfmodel describe CONFIG ...`` writes one.
"""
