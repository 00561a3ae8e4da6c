"""What a simulated step is shown as: the typed report, the memory curve, the step-time
intervals, the plotly timeline and the Chrome trace, all read from one event table."""
