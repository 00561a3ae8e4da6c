"""The built-in profiles: one JSON file per accelerator in ``sim/hardware/profiles/``, in the
same format ``calibrate`` writes. None of them is calibrated.

Every number names its public source in the profile's ``source.fields`` (a field path, or its
parent's, mapped to the citation); ``fsdpsim profiles show NAME`` prints one as a template.
"""

import json
from importlib import resources
from typing import Any


def builtin_documents(folder_name: str) -> dict[str, dict[str, Any]]:
    """The JSON documents of the package folder ``sim/hardware/<folder_name>/`` by their ``name``
    (the built-in profiles, the built-in clusters)."""
    folder = resources.files("sim.hardware") / folder_name
    docs = {}
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            doc = json.loads(entry.read_text())
            docs[doc["name"]] = doc
    return docs


BUILTIN_PROFILES: dict[str, dict[str, Any]] = builtin_documents("profiles")
