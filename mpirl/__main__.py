from mpirl.cli import entry

entry()
