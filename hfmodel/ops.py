"""Traced ops into the description's op list: kinds, owning blocks, parameters, one entry per
decoder layer (representatives copied under each layer's own names), in forward order."""

from typing import Any

from hfmodel.trace import OpRecord


def _kind(op: OpRecord, direct_3d: set[str], after_head: bool) -> str:
    t = op.module_type
    if t == "AttentionProbe":
        return "attention"
    if t == "Embedding":
        return "embed"
    if t == "Linear" or (op.gemms and t.endswith("Router")):
        return "linear"
    if "Norm" in t:
        return "norm"
    if "Rotary" in t:
        return "rotary"
    if op.owner in direct_3d:
        return "experts"
    if after_head and op.owner == "":
        return "loss"
    return "elementwise"


def _block_of(path: str, blocks: list[str]) -> int | None:
    for i, prefix in enumerate(blocks):
        if path == prefix or path.startswith(prefix + "."):
            return i
    return None


def owner_block(op: OpRecord, blocks: list[str]) -> int | None:
    """The block an op runs in (the attention probe's owner is ``attention:<module>``)."""
    return _block_of(op.owner.removeprefix("attention:"), blocks)


def _mark_saved_after_block(ops: list[OpRecord], blocks: list[str]) -> None:
    """Of each block op's saved bytes, those an op after its block saves (the block's output the
    next block's or the final norm's autograd keeps): a checkpointed block drops its saves, not
    these, unless the region that saves them is itself checkpointed (``sim.schedule.base``)."""
    for op in ops:
        block = owner_block(op, blocks)
        if block is None:
            continue
        op.saved_after_block_bytes = sum(
            nbytes
            for nbytes, savers in op.saved_by
            if any(s > op.index and owner_block(ops[s], blocks) != block for s in savers)
        )


def _mark_next_block_input(ops: list[OpRecord], blocks: list[str]) -> None:
    """Of each op's saved bytes, the input of the region after its own as that region's first op
    saves it (an fp32 RMSNorm's no-op upcast, a LayerNorm's input): the embedding's output, or a
    block's output, which the next block, or the final norm, saves. The op keeps it for its own
    region, and a checkpointed next block, which holds its input anyway, holds no second copy of it
    (``sim.schedule.base``). The traced model keeps one block of each kind
    (``hfmodel.describe.representatives``): where the final norm follows one, it stands for the
    next block's first op, receiving the block's output as that op would."""
    after_first: int | None = None  # the first op of the region after the run of ops of one region
    later: OpRecord | None = None  # the op after this one
    for op in reversed(ops):
        block = owner_block(op, blocks)
        if later is not None and owner_block(later, blocks) != block:
            after_first = later.index
        later = op
        op.next_block_input_bytes = sum(
            nbytes for nbytes, savers in op.saved_by if after_first is not None and after_first in savers
        )


def _useful(op: OpRecord) -> bool:
    return bool(
        op.flops
        or op.memory_bytes
        or op.saved_bytes
        or op.forward_transient_bytes
        or op.backward_transient_bytes
        or op.backward_flops
        or op.backward_memory_bytes
    )


def _entries(ops: list[OpRecord], calls: list[dict[str, Any]], direct_3d: set[str]) -> list[dict[str, Any]]:
    """One dict per useful op; an op that does nothing hands its host calls, its requests (a view
    makes none, but an ``empty`` does) and its backward (where it is the first to save a storage:
    ``_released_ahead``) to the next."""
    out: list[dict[str, Any]] = []
    sources: list[OpRecord] = []
    entry_of: dict[int, int] = {}  # trace op -> the entry that stands for it
    waiting: list[int] = []
    host, launches, after_head, call_iter = 0, [0, 0], False, iter(calls)
    requests: list[list[int]] = []
    checkpointed_requests: list[list[int]] = []
    backward_requests: list[list[int]] = []
    for op in ops:
        host += op.host_ops
        requests += [list(r) for r in op.forward_requests]
        checkpointed_requests += [list(r) for r in op.checkpointed_forward_requests]
        backward_requests += [list(r) for r in op.backward_requests]
        launches = [launches[0] + op.forward_launches, launches[1] + op.backward_launches]
        waiting.append(op.index)
        kind = _kind(op, direct_3d, after_head)
        attention = next(call_iter) if kind == "attention" else None
        if kind == "linear" and op.gemms and op.owner.endswith("lm_head"):
            after_head = True
        if not _useful(op) and kind != "attention":
            continue
        out.append(
            {
                "module": op.owner,
                "kind": kind,
                "flops": op.flops,
                "memory_bytes": op.memory_bytes,
                "saved_bytes": op.saved_bytes,
                "saved_after_block_bytes": op.saved_after_block_bytes,
                "next_block_input_bytes": op.next_block_input_bytes,
                "forward_transient_bytes": op.forward_transient_bytes,
                "checkpointed_forward_bytes": op.checkpointed_forward_bytes,
                "recompute_transient_bytes": op.recompute_transient_bytes,
                "backward_transient_bytes": op.backward_transient_bytes,
                "saved_pieces": list(op.saved_pieces),
                "forward_transient_pieces": list(op.forward_transient_pieces),
                "checkpointed_forward_pieces": list(op.checkpointed_forward_pieces),
                "recompute_transient_pieces": list(op.recompute_transient_pieces),
                "backward_transient_pieces": list(op.backward_transient_pieces),
                "gemms": [list(g) for g in op.gemms],
                "backward_flops": op.backward_flops,
                "backward_memory_bytes": op.backward_memory_bytes,
                "backward_gemms": [list(g) for g in op.backward_gemms],
                "attention": attention,
                "host_ops": host,
                "forward_launches": launches[0],
                "backward_launches": launches[1],
                "forward_requests": requests,
                "checkpointed_forward_requests": checkpointed_requests,
                "backward_requests": backward_requests,
            }
        )
        sources.append(op)
        entry_of.update((i, len(out) - 1) for i in waiting)
        host, launches, waiting = 0, [0, 0], []
        requests, checkpointed_requests, backward_requests = [], [], []
    for entry, op in zip(out, sources, strict=True):
        entry["saved_released_ahead"] = _released_ahead(op, entry_of)
    return out


def _released_ahead(op: OpRecord, entry_of: dict[int, int]) -> list[list[int]]:
    """Of an op's saved storages, those a later op's backward frees: autograd drops a saved
    storage when the last of its savers' backwards has run, its first saver's; as ``[entries
    ahead, bytes]`` (the op's own backward frees the rest)."""
    here = entry_of[op.index]
    ahead: dict[int, int] = {}
    for nbytes, savers in op.saved_by:
        first = entry_of.get(min(savers, default=op.index), here)
        if first > here and nbytes:
            ahead[first - here] = ahead.get(first - here, 0) + nbytes
    return [[d, n] for d, n in sorted(ahead.items())]


def _rename(entry: dict[str, Any], old: str, new: str, block: int) -> dict[str, Any]:
    module = entry["module"]
    module = new + module[len(old) :] if module == old or module.startswith(old + ".") else module
    attention = entry["attention"] and {**entry["attention"], "module": module}
    return {**entry, "module": module, "block": block, "attention": attention}


def _with_params(
    entries: list[dict[str, Any]], param_modules: dict[str, str], users: dict[str, list[str]] | None = None
) -> None:
    """Each parameter to the first op of its module (or of the nearest module that has an op); a
    tied parameter to the first op of any module that holds it (T5's shared embedding: the
    encoder's embedding lookup, not the module it was registered under, which runs nothing)."""
    first: dict[str, dict[str, Any]] = {}
    for i, e in enumerate(entries):
        e["params"], e["reuses"] = [], []
        first.setdefault(e["module"], {**e, "index": i})
    for name, module in param_modules.items():
        candidates = sorted({first[m]["index"] for m in (users or {}).get(name, []) if m in first})
        if candidates:
            entries[candidates[0]]["params"].append(name)
            for later in candidates[1:]:  # the gradient of a tied weight appears at its last user
                entries[later]["reuses"].append(name)
            continue
        path = module
        while path not in first and path:
            path = path.rpartition(".")[0]
        target = first.get(path)
        entries[target["index"] if target else 0]["params"].append(name)


def _names(entries: list[dict[str, Any]]) -> None:
    seen: dict[str, int] = {}
    for e in entries:
        base = f"{e['module']}.attention" if e["kind"] == "attention" else (e["module"] or "loss")
        seen[base] = seen.get(base, 0) + 1
        e["name"] = base if seen[base] == 1 else f"{base}#{seen[base]}"


def assemble_ops(
    ops: list[OpRecord], calls: list[dict[str, Any]], meta: dict[str, Any], blocks: list[str]
) -> list[dict[str, Any]]:
    """The ops in forward order, every block's from its representative's. The ops outside blocks
    stay where they ran: an encoder-decoder's encoder stack, its final norm and the decoder's
    embedding, then the decoder stack and the head. The traced model holds each stack's
    representatives only; a stack's blocks are emitted, all of them, where its first traced
    block ran (ops between a stack's blocks, should a model have any, come after it)."""
    _mark_saved_after_block(ops, blocks)
    _mark_next_block_input(ops, blocks)
    entries = _entries(ops, calls, set(meta["direct_3d"]))
    for e in entries:
        e["block"] = _block_of(e["module"], blocks)
    stacks = [b.rpartition(".")[0] for b in blocks]
    out: list[dict[str, Any]] = []
    emitted: set[str] = set()
    for e in entries:
        if e["block"] is None:
            out.append(e)
            continue
        stack = stacks[e["block"]]
        if stack in emitted:
            continue
        emitted.add(stack)
        for i, rep in enumerate(meta["reps"]):
            if stacks[i] == stack:
                out += [_rename(x, blocks[rep], blocks[i], i) for x in entries if x["block"] == rep]
    _with_params(out, meta["param_modules"], meta.get("param_users"))
    _names(out)
    return out
