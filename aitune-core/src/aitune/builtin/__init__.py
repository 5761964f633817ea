"""Core's own plugins: the eager backend and the default implementation of every operation hook."""
