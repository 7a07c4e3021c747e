"""Engine adapters: one contract (base.py), built-ins registered by name, plugins by import path."""
