"""Errors that are the user's to fix: the CLI prints them as one line and exits with code 2."""


class UserError(Exception):
    """A mistake in a scenario, a profile, a flag or a path; the message names the file and field."""
