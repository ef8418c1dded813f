from lifecycle.cli import entry

entry()
