"""`python -m moepass.cli`: the moepass command line."""

from moepass.cli import main

main()
