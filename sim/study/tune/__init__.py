"""``fsdpsim tune``: the fastest configuration that fits, found by bounded search."""
