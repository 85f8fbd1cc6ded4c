"""The rulebook: the layout record, its rules, events and state, the layout and content values."""
