"""Helpers for tests and demos on a CPU: the model-less daemon, process control, shared experts.

Import-light on purpose (nothing imported here): each helper module imports what it needs.
"""
