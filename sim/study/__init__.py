"""What-if studies over many simulated steps: sweeps and the tuner."""
