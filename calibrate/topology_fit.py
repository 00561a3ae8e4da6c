"""Calibration meets topology on the calibrate side: after a NCCL calibration (measured here, or
imported from nccl-tests), fit NCCL's cost model to the profile's curves on the cluster they were
measured on (``sim.costs.nccl_fit``) and record the fit, and the cluster, in the profile, so the
simulator extrapolates to other node counts through the model."""

from typing import Any

from sim.costs.nccl_fit import fit_document, fit_nccl
from sim.hardware.cluster_spec import default_cluster, load_cluster
from sim.hardware.parse import profile_from_dict


def attach_nccl_fit(doc: dict[str, Any], cluster: str | None, where: str) -> str:
    """Add ``topology.nccl_fit`` (and ``node.cluster`` when ``cluster`` names one) to a NCCL
    profile document; returns a line saying what was done. Without a cluster whose nodes have
    NICs, curves across nodes cannot be placed: the fit is skipped and the line says why."""
    if doc.get("backend", {}).get("name") != "nccl":
        return "no NCCL fit: the backend is not NCCL"
    if cluster is not None:
        doc.setdefault("node", {})["cluster"] = cluster
    profile = profile_from_dict(doc, where)
    spec = (
        load_cluster(cluster, where=f"{where}: --cluster")
        if cluster
        else default_cluster(profile, profile.gpus_per_node)
    )
    spans = any(c.spans_nodes for c in profile.collectives)
    if spans and spec.nics_per_node == 0:
        return "no NCCL fit: curves span nodes but the profile names no cluster; pass --cluster NAME"
    fit = fit_nccl(profile, spec)
    doc["topology"]["nccl_fit"] = fit_document(fit)
    return f"NCCL model fitted: {fit.source}"
