"""Training drafters on this machine: data collection from the target, training loops, export."""
