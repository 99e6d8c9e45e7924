"""Reliability figures on real mounts, one module per part (see __main__.py for the CLI).

The programs it runs as another user (holder, flooder, print_array) and the fault-injecting
filesystem (faultfs) import this package: keep this file empty of imports.
"""
