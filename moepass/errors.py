"""The one error type moepass raises for bad input.

Its message is a single line that names the file, tensor or key at fault; the CLI prints it
and exits with status 2.
"""


class MoepassError(Exception):
    """Bad input or an impossible request, with a one-line message for the user."""
