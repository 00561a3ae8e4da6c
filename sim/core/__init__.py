"""The engine and what it runs: ranks, streams, process groups, programs and the event table.

Knows nothing of FSDP; imports nothing else of ``sim`` but ``sim.errors``."""
