"""What is trained: model dimensions and parameters, layer ops with FLOPs and activation bytes,
wrap units, and the option enums a scenario chooses from."""
