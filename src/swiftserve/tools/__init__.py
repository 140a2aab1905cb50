"""Tooling never imported at run time: the demo model, its training and evaluation, random checkpoints."""
