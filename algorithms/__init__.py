"""One module per algorithm, installed as ``mpirl.algorithms``: a config and a training step."""
