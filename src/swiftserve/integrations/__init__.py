"""Adapters to other serving systems (optional extras)."""
