"""What streams between host and device during a step: a block's weights (weights.py),
saved activations (activations.py), and the attention kernel the blocks run (attention.py)."""
