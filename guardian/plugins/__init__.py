"""Built-in plugins, registered exactly like third-party ones."""
