"""The engine side of the plugin."""
