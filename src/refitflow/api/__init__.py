"""The public surface: Publisher, Receiver, Registry and the CLI."""
