"""TrainStream."""
