"""FSDP2's memory tracker, told where its peak happened, and its snapshot in the simulator's terms.

Split from ``validation.fake_memory``, whose FSDP2 step runs under ``peak_tracker_class()`` and
reports the peak snapshot through ``categories``. ``FSDPMemTracker``
(``torch.distributed._tools.fsdp2_mem_tracker``) gives the peak bytes by its own categories only;
the subclass also notes the op, phase and modules at the peak (with ``detail``, the live
storages), which is what a wrong prediction is traced back with.
"""

from collections import Counter
from typing import Any

import torch

from validation.tracker_categories import tracker_key_name

PEAK_TOP = 10  # storage sizes listed per category in ``peak_detail``


def peak_tracker_class() -> type:
    """``PeakTracker``, made on call: torch's tracker is imported only when a measurement runs."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    class PeakTracker(FSDPMemTracker):
        """FSDPMemTracker that also notes where the peak happened (and, with detail, what was live)."""

        def __init__(self, *args: Any, detail: bool = False, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.detail = detail
            self.last_op = ""
            self.peak_where: dict[str, Any] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.last_op = str(func)
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _track(self, reftype: Any, t: torch.Tensor) -> None:
            super()._track(reftype, t)
            if self.detail:  # note the op that created each storage
                from torch.distributed._tools.common_utils import get_untyped_storages

                for st in get_untyped_storages(t):
                    winfo, _ = self._WINFO.get(st, (None, None))
                    if winfo is not None and not hasattr(winfo, "created_by"):
                        winfo.created_by = self.last_op.removeprefix("aten.").removesuffix(".default")

        def _update_peak_stats(self, peak_state: Any) -> None:
            before = dict(self._peak_mem)
            super()._update_peak_stats(peak_state)
            if self._peak_mem != before:
                phase = "optimizer" if self._in_opt else "backward" if self._mod_tracker.is_bw else "forward"
                self.peak_where = {
                    "op": self.last_op,
                    "phase": phase,
                    "modules": sorted(self._mod_tracker.parents),
                }
                if self.detail:
                    self.peak_where["storages"] = self._live_storages()

        def _live_storages(self) -> dict[str, list[list[Any]]]:
            """Per tracker category, the largest groups of live storages: [[bytes, count, op], ...]."""
            sizes: Counter[tuple[str, int, str]] = Counter()
            for winfo, w_st in list(self._WINFO.values()):
                if w_st() is not None and winfo.mem_consumed > 0:
                    op = getattr(winfo, "created_by", "before the step")
                    sizes[(tracker_key_name(winfo.reftype), winfo.mem_consumed, op)] += 1
            out: dict[str, list[list[Any]]] = {}
            for (category, nbytes, op), count in sorted(sizes.items(), key=lambda kv: -kv[0][1] * kv[1]):
                if len(out.setdefault(category, [])) < PEAK_TOP:
                    out[category].append([nbytes, count, op])
            return out

    return PeakTracker
