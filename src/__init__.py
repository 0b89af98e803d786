"""The template's building blocks, one concern per module; train.py puts them together."""
