"""One piece of a forward pass as the simulator sees it (``LayerOp``): its kind, FLOPs, memory
traffic, the bytes it saves and holds and the tensors they are made of, its GEMM shapes and host
work. ``sim.workload.layers`` builds a Llama's ops; ``sim.workload.described`` a measured model's.
"""

from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property

from sim.workload.params import ParamSpec
from sim.workload.shapes import AttentionShape, Request


class LayerKind(StrEnum):
    EMBED = "embed"
    NORM = "norm"
    LINEAR = "linear"
    ATTENTION = "attention"
    MLP_ACT = "mlp_act"
    ROTARY = "rotary"
    LOSS = "loss"
    EXPERTS = "experts"  # a mixture of experts' grouped matmuls
    ELEMENTWISE = "elementwise"  # a module's own work between its children (residual adds, RoPE)


class CalibrationGroup(StrEnum):
    """Groups of layer ops whose times ``calibrate compute`` measures as one."""

    EMBED = "embed"
    BLOCK = "block"
    HEAD = "head"


def figure_tensors(owner: object, figure: str) -> tuple[int, ...]:
    """The tensors of ``owner``'s byte figure ``figure`` (its ``<figure>_bytes`` and
    ``<figure>_pieces``): the pieces where they account for it exactly, else the figure as one
    tensor (none for zero bytes)."""
    nbytes = getattr(owner, f"{figure}_bytes") or 0
    pieces = getattr(owner, f"{figure}_pieces")
    if pieces and sum(pieces) == nbytes:
        return tuple(pieces)
    return (nbytes,) if nbytes > 0 else ()


@dataclass(frozen=True, kw_only=True)
class LayerOp:
    """One piece of the forward pass, in execution order.

    ``module`` is the module that runs it (FSDP hooks fire on wrapped modules that contain it);
    ``memory_bytes`` is the traffic of its memory-bound (elementwise) work in forward.
    """

    name: str
    module: str
    kind: LayerKind
    block: int | None
    params: tuple[ParamSpec, ...]
    flops: float
    memory_bytes: float
    saved_bytes: int
    # of saved_bytes, what ops after its block save: a checkpointed block keeps these where the
    # region after it is not checkpointed (measured for described models; 0 for the analytic ones)
    saved_after_block_bytes: int = 0
    # of saved_bytes, the next block's input as that block's first op saves it (an fp32 RMSNorm's
    # no-op upcast, a LayerNorm's input; measured for described models, whose saves are counted
    # at the op that made them; the analytic ones count it at its saver, ``saved_input_bytes``):
    # where the next block is checkpointed it holds that tensor as its kept input
    next_block_input_bytes: int = 0
    # of saved_bytes, those a later op's backward frees, as (ops ahead, bytes): a storage lives
    # until its first saver's backward (measured for described models); the rest its own frees
    saved_released_ahead: tuple[tuple[int, int], ...] = ()
    # of saved_bytes, the op's input itself, saved as it is (an fp32 RMSNorm's ``to(float32)``
    # returns its input): first in a checkpointed block, the block's kept input is that tensor
    saved_input_bytes: int = 0
    forward_transient_bytes: int = 0
    backward_transient_bytes: int = 0
    # what its block holds during it when the block is checkpointed (measured for described
    # models' block ops; None: the analytic ones, whose checkpointed segments hold saved + transient)
    checkpointed_forward_bytes: int | None = None
    # what it holds beyond the saves as its block is recomputed: its forward transient of what its
    # block's ops made (measured for described models' block ops; None: the forward transient)
    recompute_transient_bytes: int | None = None
    # the tensors each byte figure above is made of, in allocation order, where known (a
    # described model's, measured; the attention kernel's from its formulas); empty: one tensor
    saved_pieces: tuple[int, ...] = ()
    forward_transient_pieces: tuple[int, ...] = ()
    backward_transient_pieces: tuple[int, ...] = ()
    checkpointed_forward_pieces: tuple[int, ...] = ()
    recompute_transient_pieces: tuple[int, ...] = ()
    # the order of its forward's allocations and frees (``Request``s), and where its block is
    # checkpointed; None: not known (the analytic ops), the figures' tensors then serve
    forward_requests: tuple[Request, ...] | None = None
    checkpointed_forward_requests: tuple[Request, ...] | None = None
    # its backward's requests: what it makes and frees, a free of a tensor its forward kept (or
    # of a kept storage an earlier op made) that tensor's release; an attention op's begins with
    # its kernel's (``attention_kernel_backward_requests``)
    backward_requests: tuple[Request, ...] | None = None
    gemm: tuple[int, int, int] | None = None  # (M, N, K) of a linear's forward matmul
    # several matmuls in one op, each (M, N, K, count): grouped expert matmuls, a LoRA linear
    grouped_gemms: tuple[tuple[int, int, int, int], ...] = ()
    attention: AttentionShape | None = None
    host_ops: int = 0  # Python-level torch calls of the eager forward
    # the kernels its forward and backward launch, where measured (``hfmodel.trace``; the
    # attention kernel's own excepted: ``ATTENTION_LAUNCHES``); None: one per eager call forward,
    # two backward
    launches: tuple[int, int] | None = None
    backward_memory_factor: float = 2.0  # backward bytes over forward bytes of the memory-bound work
    # its memory-bound work is one fused kernel (a Triton RMSNorm): it streams, where eager ATen
    # kernels reach only part of the streaming rate
    fused_kernel: bool = False
    # torchtitan's op-level selective checkpointing keeps this op's output (a matmul but every
    # second one in its block, or the attention kernel) instead of recomputing it: its bytes
    sac_kept_bytes: int = 0
    # the op computes its input's and weight's gradients in its forward (a fused linear
    # cross-entropy): its backward matmuls run in forward, and its backward only scales them
    gradients_in_forward: bool = False
    # what the backward runs, where measured (a described model): its matmuls (M, N, K, count),
    # FLOPs (the attention kernel's included) and elementwise bytes; None: the analytic backward
    # (an input- and a weight-gradient matmul per forward matmul, ``backward_memory_factor``)
    backward_gemms: tuple[tuple[int, int, int, int], ...] | None = None
    backward_flops: float | None = None
    backward_memory_bytes: float | None = None
    # tied parameters an earlier op owns that this one uses again (T5's shared embedding in the
    # decoder's embedding and the head): their gradient appears at the last user's backward
    reuses: tuple[str, ...] = ()

    def tensors(self, figure: str) -> tuple[int, ...]:
        """The tensors of one byte figure (``saved``, ``forward_transient``, ``backward_transient``,
        ``checkpointed_forward``): ``figure_tensors``."""
        return figure_tensors(self, figure)

    @cached_property
    def group(self) -> CalibrationGroup | None:
        """The measured group this op belongs to; None for work ``calibrate compute`` does not time."""
        if self.block is not None:
            return CalibrationGroup.BLOCK
        if self.kind is LayerKind.ROTARY:
            return None
        return CalibrationGroup.EMBED if self.kind is LayerKind.EMBED else CalibrationGroup.HEAD
