"""The package's version and the version of its JSON outputs, at the bottom of the import graph: every
module may import this one, and it imports nothing."""

__version__ = "0.1.0"

SCHEMA_VERSION = "2.2"
"""The version of every JSON output's shape (``schema_version`` in each, ``oomdoctor schema COMMAND``). The
major number changes when a field is removed or changes meaning; the minor number when fields are added."""
