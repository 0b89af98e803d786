"""A fork's file with a mistake that shows only as it is imported (a name never imported): the
config that names a class of it is told what the import raised, not that the class is missing."""

Net = nn.Linear  # noqa: F821 - the mistake: `from torch import nn` was forgotten
