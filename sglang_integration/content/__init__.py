"""Slot content: fingerprints computed on the weights' device."""
