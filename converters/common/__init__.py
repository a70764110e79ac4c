"""What every format's package shares: path and name checks, the allow-list unpickler, the old module names."""
