"""Training schedules written as engine programs: a shared builder base, FSDP2 and DDP, and the
one model-state formula they, the report and the tuner share."""
