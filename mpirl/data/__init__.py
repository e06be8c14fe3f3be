"""Data: the replay buffer, trajectory dumps (writer, index, reader) and offline input.
"""
