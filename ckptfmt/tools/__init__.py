"""What people read: verify, diff, the description of a checkpoint, number and size formatting, and the
Output that writes tables, messages and JSON for the CLI and the converters' commands.
"""
