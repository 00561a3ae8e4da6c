"""Where a fake-mode step would leave the real step's path, the patches that keep it on it.

Split from ``validation.fake_memory``, which enters all three around its measured step. Each
patch replaces one library function for the length of a ``with`` block and changes only what a
FakeTensor cannot answer (a tensor's values, its data pointer, a real rank tensor); what the
libraries then do is their own:
- ``one_sequence_per_row``: transformers' packed-sequence test (``masking_utils``);
- ``catch_all_reshard_by_storage``: FSDP1's final reshard (``_runtime_utils._catch_all_reshard``);
- ``post_forward_meshes_outside_fake_mode``: FSDP2's post-forward mesh
  (``_fsdp_init._get_post_forward_mesh_info``).
"""

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from sim.errors import UserError


@contextlib.contextmanager
def one_sequence_per_row(model: nn.Module, *, padded: bool = False, packed: bool = False) -> Iterator[None]:
    """Decide transformers' causal mask as the real run does: no packed sequences, and where the
    rows are padded (``padded``: ``validation.build.batch`` passes a padding ``attention_mask``) a
    materialised mask; where they are packed (``packed``: the batch passes ``position_ids``
    restarting at each document) the packed sequences transformers finds in them.

    Without a KV cache and without an ``attention_mask``, transformers' ``create_causal_mask``
    looks for packed sequences in ``position_ids`` (``masking_utils.find_packed_sequence_indices``:
    a position that does not follow its predecessor starts a new sequence). Reading the positions
    is data dependent, so for a FakeTensor (``is_tracing`` counts FakeTensors as tracing) it gives
    up and returns its fake result as if packed; ``create_causal_mask`` then materialises a mask
    instead of leaving SDPA its ``is_causal`` flag, and with GQA ``repeat_kv`` copies K and V
    (``use_gqa_in_sdpa`` needs no mask). Real runs, on the CPU and on GPUs alike, read the
    positions, find one sequence per row and take the mask-free path.

    Inside this context a FakeTensor of positions is answered "not packed" (None), which is
    exactly what the real run finds: ``validation.worker`` passes only ``input_ids`` and
    ``labels``, so the positions are the model's own ``arange(seq_len)`` on every row. A forward
    that is given ``position_ids`` or an ``attention_mask`` (whose values fake tensors lack)
    raises a UserError instead of being measured on the wrong path, but for the padding mask of
    padded rows: transformers reads a FakeTensor mask as tracing and materialises the mask
    (``_ignore_causal_mask_sdpa`` returns False), which is what the real mask's padding decides;
    and the positions of packed rows, whose fake result transformers' own function keeps as
    packed, which is what positions restarting in every row decide. Real tensors, and everything
    outside the context, keep transformers' own decision.
    """
    from torch._subclasses.fake_tensor import FakeTensor
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        if isinstance(position_ids, FakeTensor) and not packed:
            return None  # the model's own arange positions: one sequence per row
        return original(position_ids)

    def refuse_value_inputs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        read = tuple(
            name for name, given in (("position_ids", packed), ("attention_mask", padded)) if not given
        )
        given = [k for k in read if kwargs.get(k) is not None]
        if given:
            raise UserError(
                f"fake memory measurement: the step passes {' and '.join(given)}; deciding the "
                "attention mask from them needs their values, which fake tensors do not have"
            )

    hook = model.register_forward_pre_hook(refuse_value_inputs, with_kwargs=True)
    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original
        hook.remove()


@contextlib.contextmanager
def catch_all_reshard_by_storage() -> Iterator[None]:
    """FSDP1's final callback reshards what no hook did (``_catch_all_reshard``: a frozen flat
    parameter whose unit's inputs need no gradient) unless ``flat_param.data_ptr()`` is already its
    local shard's; every fake tensor's pointer is 0, so in fake mode it never reshards and the
    unsharded parameters live into the next step. The same test by storage identity, which fake
    tensors keep; the reshard itself is FSDP1's."""
    from torch.distributed.fsdp import _runtime_utils
    from torch.multiprocessing.reductions import StorageWeakRef

    original = _runtime_utils._catch_all_reshard

    def by_storage(state: Any) -> None:
        handle = state._handle
        if not handle:
            return
        flat = handle.flat_param
        same = (
            StorageWeakRef(flat.untyped_storage()).cdata
            == StorageWeakRef(flat._local_shard.untyped_storage()).cdata
        )
        if same and not handle._skipped_use_sharded_views:
            return
        _runtime_utils._reshard(state, handle, _runtime_utils._should_free_in_backward(state, handle))

    _runtime_utils._catch_all_reshard = by_storage
    try:
        yield
    finally:
        _runtime_utils._catch_all_reshard = original


@contextlib.contextmanager
def post_forward_meshes_outside_fake_mode() -> Iterator[None]:
    """An integer ``reshard_after_forward`` makes ``fully_shard`` build a post-forward
    ``DeviceMesh`` (``_fsdp_init._get_post_forward_mesh_info``), whose rank tensors must be real,
    as ``_mesh`` builds the step's mesh outside the fake mode; the mesh itself is FSDP2's own."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.fsdp._fully_shard import _fsdp_init, _fully_shard

    original = _fsdp_init._get_post_forward_mesh_info

    def outside(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return original(*args, **kwargs)

    _fsdp_init._get_post_forward_mesh_info = outside
    _fully_shard._get_post_forward_mesh_info = outside
    try:
        yield
    finally:
        _fsdp_init._get_post_forward_mesh_info = original
        _fully_shard._get_post_forward_mesh_info = original
