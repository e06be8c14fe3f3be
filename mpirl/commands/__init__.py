"""The commands on top: train, evaluate, export and inspect. ``mpirl.cli`` parses arguments and
calls them.
"""
