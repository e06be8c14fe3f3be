"""Config dataclasses, the ranges of their keys, and building a config from JSON.
"""
