"""``fsdpsim sweep``: variants of a scenario, run on local cores, Ray or Dask, tabulated and plotted."""
