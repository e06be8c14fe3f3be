"""What a run shows and writes about itself: the progress display, TensorBoard and other
loggers, plots. Rank 0 only.
"""
