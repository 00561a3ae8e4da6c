"""The built-in profiles: one JSON file per accelerator in ``sim/hardware/profiles/``, in the
same format ``calibrate`` writes. None of them is calibrated.

Every number names its public source in the profile's ``source.fields`` (a field path, or its
parent's, mapped to the citation); ``fsdpsim profiles show NAME`` prints one as a template.
"""

import json
from importlib import resources
from typing import Any


def _load_all() -> dict[str, dict[str, Any]]:
    folder = resources.files("sim.hardware") / "profiles"
    docs = {}
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            doc = json.loads(entry.read_text())
            docs[doc["name"]] = doc
    return docs


BUILTIN_PROFILES: dict[str, dict[str, Any]] = _load_all()
