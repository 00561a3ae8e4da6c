"""Scenario files: TOML in, a frozen, fully resolved ``Scenario`` out."""
