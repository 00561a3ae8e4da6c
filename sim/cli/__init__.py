"""The ``fsdpsim`` command line: one module per verb, one argument parser class."""
