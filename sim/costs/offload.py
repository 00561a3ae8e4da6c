"""Time of offload's transfers and of the optimizer on the host. Pure functions of a profile's
``node`` section (``sim.hardware.schema.NodeSpec``).

- Host-to-device and device-to-host copies run over the GPU's own PCIe link at its measured
  pinned rate, else the PCIe datasheet rate (``NodeSpec.pcie_Bps``); DeepSpeed and FSDP1 copy
  from pinned buffers.
- NVMe is the node's: its read and write bandwidth is shared by the node's ranks, each
  getting an equal share (ZeRO-Infinity swaps every rank's partitions at once).
- Copies from or into pageable host memory (FSDP2's ``CPUOffloadPolicy(pin_memory=False)``) run
  at the measured pageable rates (``pageable_host_to_device_Bps``, ``pageable_device_to_host_Bps``).
- The optimizer on the host: DeepSpeed's CPU Adam (ZeRO-Offload) or ``torch.optim.AdamW`` /
  ``SGD`` on CPU tensors (FSDP1's CPUOffload, FSDP2's CPUOffloadPolicy), seconds per parameter
  element for one rank, from ``fsdpsim calibrate host`` run on the training host.
A figure the profile lacks is a ``UserError`` when a scenario needs it, naming the field and
how to measure it.
"""

from dataclasses import dataclass

from sim.errors import UserError
from sim.hardware.schema import NodeSpec
from sim.workload.options import OptimizerName


@dataclass(frozen=True, kw_only=True)
class HostCosts:
    node: NodeSpec
    ranks_per_node: int
    profile: str  # for messages
    # the device is the host (``HardwareProfile.host_is_device``): offload moves nothing
    host_is_device: bool = False

    def _need(self, value: float | None, field: str, how: str) -> float:
        if value is None:
            raise UserError(f"profile {self.profile}: node.{field} is missing; offload needs it ({how})")
        return value

    def h2d_s(self, nbytes: float, *, pinned: bool = True) -> float:
        if not pinned:
            how = "`fsdpsim calibrate host` on a GPU machine"
            return nbytes / self._need(
                self.node.pageable_host_to_device_Bps, "pageable_host_to_device_Bps", how
            )
        rate = self._need(self.node.h2d_Bps(), "host_to_device_Bps", "or node.pcie_gen")
        return nbytes / rate

    def d2h_s(self, nbytes: float, *, pinned: bool = True) -> float:
        if not pinned:
            how = "`fsdpsim calibrate host` on a GPU machine"
            return nbytes / self._need(
                self.node.pageable_device_to_host_Bps, "pageable_device_to_host_Bps", how
            )
        rate = self._need(self.node.d2h_Bps(), "device_to_host_Bps", "or node.pcie_gen")
        return nbytes / rate

    def nvme_read_s(self, nbytes: float) -> float:
        rate = self._need(
            self.node.nvme_read_Bps, "nvme_read_Bps", "`fsdpsim calibrate host --nvme-path DIR`"
        )
        return nbytes * self.ranks_per_node / rate

    def nvme_write_s(self, nbytes: float) -> float:
        rate = self._need(
            self.node.nvme_write_Bps, "nvme_write_Bps", "`fsdpsim calibrate host --nvme-path DIR`"
        )
        return nbytes * self.ranks_per_node / rate

    def cpu_adam_s(self, numel: int) -> float:
        per = self._need(self.node.cpu_adam_s_per_param, "cpu_adam_s_per_param", "`fsdpsim calibrate host`")
        return numel * per

    def cpu_adamw_s(self, numel: int) -> float:
        per = self._need(
            self.node.cpu_torch_adamw_s_per_param, "cpu_torch_adamw_s_per_param", "`fsdpsim calibrate host`"
        )
        return numel * per

    def cpu_torch_optimizer_s(self, optimizer: OptimizerName, numel: int) -> float:
        """``torch.optim`` (foreach) stepping ``numel`` fp32 elements on the host's CPU."""
        if optimizer is OptimizerName.NONE:
            return 0.0
        if optimizer is OptimizerName.SGD:
            per = self._need(
                self.node.cpu_torch_sgd_s_per_param, "cpu_torch_sgd_s_per_param", "`fsdpsim calibrate host`"
            )
            return numel * per
        return self.cpu_adamw_s(numel)
