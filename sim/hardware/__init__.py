"""What it runs on: the hardware profile format, the built-in profiles and the registry that
resolves a profile by name or path."""
