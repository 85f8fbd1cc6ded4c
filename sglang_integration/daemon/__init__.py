"""The daemon side of the plugin."""
