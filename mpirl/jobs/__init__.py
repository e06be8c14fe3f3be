"""Jobs: checkpoints, run directories, the launch supervisor, the command-line grammar and Slurm.
"""
