"""zarr v3 groups written by tensorstore."""
